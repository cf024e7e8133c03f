"""Development tooling of lowmem-ft: test and benchmark models, the estimator's accuracy harness.

Not part of the installed package (the wheel ships `lowmem_ft` only): tests and `scripts/` import it from the
repository root. Nothing under `lowmem_ft/` may import it.
"""
