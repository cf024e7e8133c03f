"""The training step traced at full size on shape-only tensors: the step, fewer layers extrapolated, --verify."""
