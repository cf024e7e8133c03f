"""The GPU check of the memory model: `check` runs on the lent GPU machine (through `scripts/gpu_check.sh`), `report`
turns its `results.jsonl` into `benchmarks/estimator_gpu.md`, `kit` builds the wheels the machine's image lacks,
`settings` holds the limits both obey (what travels, the deadline, each step's expected time).

One-way: `check` imports `report`; both import the harness (`devkit.harness.estimator`), never each other back.
"""
