"""The memory model: architecture description, per-component peak estimate, the target, and the planner over `Setup`
variants (pure arithmetic: no torch, no recipe)."""
