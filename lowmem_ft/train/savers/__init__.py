"""The long-context memory savers applied to a built model: tiled MLP and norms, LoRA recompute, host embeddings."""
