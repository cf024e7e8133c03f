"""Development tooling of lowmem-ft: test models, the memory model's measuring harnesses, benchmarks, the GPU kit.

Not part of the installed package (the wheel ships `lowmem_ft` only): run it from the repository root, where
`python -m devkit.<module>` finds it (tests find it through pytest's `pythonpath`). Nothing under `lowmem_ft/` may
import it, and nothing in it edits `sys.path`.

- `devkit.tiny`, `devkit.zoo`: the embedded tiny Qwen2 and the zoo of tiny replicas of each model family
  (`python -m devkit.tiny` writes `models/tiny-qwen2`); `devkit.example_data` writes `examples/chat.jsonl`;
  `devkit.wandb_offline` reads an offline W&B run file.
- `devkit.harness`: real training steps measured exactly beside the memory model's prediction (whole steps, long
  context, mixtures of experts, one decoder layer).
- `devkit.bench`: the scripts that write the tables under `benchmarks/` (`python -m devkit.bench.<name> --out FILE`).
- `devkit.gpu`: the GPU check (`scripts/gpu_check.sh` runs `devkit.gpu.check`; `devkit.gpu.report` turns its results
  into `benchmarks/estimator_gpu.md`; `devkit.gpu.kit` builds the wheels it carries).
"""
