"""How each training method is set up on TRL's trainers: preference (DPO, ORPO, SimPO, KTO), GRPO and its rewards."""
