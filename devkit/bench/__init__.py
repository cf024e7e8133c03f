"""The scripts that write the tables under `benchmarks/`; each table's header names the command that made it.

| module | writes |
| --- | --- |
| `estimator` | `estimator_cpu.md` (`--holdout` too), `estimator_zoo.md` (`--zoo`), `estimator_blocks.md` (`--blocks`) |
| `estimator_moe` | `estimator_moe.md` |
| `estimator_preference` | `estimator_preference.md` (DPO and its loss types, ORPO, SimPO, KTO on TRL's trainers) |
| `estimator_vision` | `estimator_vision.md` (image steps on the tiny Qwen2.5-VL: tower frozen / LoRA, images, caps) |
| `long_context` | `long_context_cpu.md` |
| `long_context_predicted` | `long_context_predicted.md` (memory model only, no torch) |
| `max_context` | `max_context.md` (planner only, no torch) |
| `context` | `context_cpu.md` |
| `context_quality` | `context_quality.md` |
| `savers` | `savers_cpu.md` |
| `monitor_overhead` | `monitor_overhead.md` |
| `packing` | `packing.md` (its data: `skewed_data`) |
| `tokenization` | `tokenize.md` (its data: `skewed_data`) |
| `plan_latency` | `plan_latency.md` |
| `robust` | `robust_cpu.md` |

`estimator_gpu.md` comes from the GPU check (`devkit.gpu`).
"""
