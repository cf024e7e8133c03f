"""Training: a recipe built into a model, LoRA and TRL trainer, run into a run directory, by concern.

`run.FineTune` reads as the recipe it runs — build, fit, finalize — and asks the run's method for what differs
between methods; `ending.RunRecord` records how the run ended. Beside them, the modules every run builds with:
`args` (the trainer arguments), `device` (allocator, GPU, `--vram` cap), `model` (tokenizer, base model, adapters),
`init_conversion` (PiSSA / OLoRA), `losses` (the loss with or without the full logits).

The rooms (tests/test_imports.py holds what each may import):

- `methods/` — one module per training method behind the `Method` protocol and its registry: `sft`, `preference`
  (DPO, ORPO, SimPO, KTO), `grpo` with its `rewards`.
- `resilience/` — keeping a run alive: the memory-safe trainer and step (`trainer`, `split`, `dropout`, `order`),
  the memory policy (`guard`, `early`), whole-or-absent checkpoints (`checkpoints`), stopping on a signal
  (`interrupt`).
- `observe/` — what a run shows: the memory monitor (`monitor`), the progress and done lines (`progress`), the
  `banner`, the trackers (`tracking`), the whole run's `totals`, and what a GPU run's first steps teach about the
  device (`calibrating`, into `lowmem_ft.calibrated`). Observers observe; the guard decides.
- `savers/` — long-context memory savers applied to a built model (`apply`): token `tiles`, recomputed LoRA
  (`lora_recompute`), input embeddings in host memory (`host_embeddings`).
- `measure/` — the yardsticks of the memory model: exact peak bytes (`peak`), a CPU run's exact memory beside its
  prediction (`exact`), the CUDA caching allocator replayed (`allocator`), a GPU's context, workspaces and allocator
  measured without training (`cuda_overheads`, `doctor --calibrate`). They know the memory model, not the trainer.
- `trace/` — the real step at full size without weights (`step`), the image batches a vision-language plan priced
  (`images`), fewer layers extrapolated (`layers`), one rank of an FSDP2 step on a fake process group (`sharded`),
  `--verify` against the plan (`verify`).
- `distributed/` — several processes: the launch (`launch`) and the ranks of one run (`ranks`).
"""
