"""Keeping a run alive: the OOM-safe trainer, the memory guard, cutting batches, order, checkpoints, signals."""
