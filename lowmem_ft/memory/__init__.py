"""The memory model: architecture description, per-component peak estimate, and the planner (no torch here)."""
