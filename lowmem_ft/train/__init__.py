"""Training: building the model, LoRA and optimizer from a recipe, and running TRL's SFTTrainer into a run directory."""
