"""Checking the memory model against reality: real training steps on a random-initialized model, measured exactly.

One grid point = build the model through `lowmem_ft.train.model.build_model` (the path `train` uses), install TRL's
fused LM head as `SFTTrainer` does, create the optimizer the way transformers' Trainer does for the recipe's
`optim`, run two optimizer steps (the second with gradient accumulation 2, so optimizer states and accumulated
gradients coexist with the activations, as in a steady-state step), and take `PeakMemory`'s exact peak of live
tensor bytes. The prediction is `lowmem_ft.memory.estimate` for the same setup with device overheads excluded.
Used by `devkit/bench/estimator.py` (the table) and `tests/devkit/test_harness_estimator.py` (a tiny grid).
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from lowmem_ft.choosing import setup_from_recipe
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import Estimate, estimate
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.args import OPTIM_NAMES


@dataclass
class Point:
    arch: str
    adapter: str  # full | lora | qlora
    optimizer: str
    checkpointing: bool
    batch: int
    seq: int
    measured: int = 0
    predicted: float = 0.0
    # phase → (peak bytes within the phase, live bytes at its end), measured and predicted
    phases: dict[str, tuple[int, int]] = field(default_factory=dict)
    predicted_phases: dict[str, float] = field(default_factory=dict)

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def write_model(config: dict[str, Any], out: Path, seed: int = 0) -> Path:
    """A random-initialized model of `config` saved to `out` (bf16 safetensors, like a Hub checkpoint)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    model.save_pretrained(out)
    (out / "lowmem_config.json").write_text(json.dumps(config))
    return out


def recipe_for(model_dir: Path, p: Point):
    overrides = {
        "model": {"name_or_path": str(model_dir), "quantization": "nf4" if p.adapter == "qlora" else "none"},
        "adapter": {"kind": "full" if p.adapter == "full" else "lora", "r": 8},
        "optimizer": {"name": p.optimizer},
        "memory": {
            "gradient_checkpointing": p.checkpointing,
            "micro_batch_size": p.batch,
            "max_seq_len": p.seq,
            "gradient_accumulation": 1,  # each micro batch is let go before the next: see `trainer_batches`
        },
    }
    return resolve(None, overrides)


def trainer_batches(vocab: int, rows: int, lengths: list[int], gen=None, device: str = "cpu"):
    """The micro batches of `lengths` tokens as a training run holds them: `(input_ids, attention_mask, labels)`,
    int64, labels a tensor of their own (TRL's collator pads them separately); one row of a padded batch masked
    at its start. On the CPU the loader's next batch exists before the current one runs (accelerate's
    DataLoaderShard iterates one ahead; on CUDA that one is still on the host), so each is made one batch ahead —
    what the memory model's batch term counts (`lowmem_ft.memory.estimate.BATCH_BYTES_PER_TOKEN`, accumulation 1)."""
    import torch

    def make(seq: int):
        ids = torch.randint(0, vocab, (rows, seq), generator=gen, device=device)
        mask = torch.ones_like(ids)
        if rows > 1:
            mask[-1, : seq // 4] = 0  # left padding on one row: the mask a padded batch carries
        return ids, mask, ids.clone()

    ahead = [make(lengths[0])]
    for i in range(len(lengths)):
        if device == "cpu":
            ahead.append(make(lengths[min(i + 1, len(lengths) - 1)]))
        yield ahead.pop(0)


def measure(model_dir: Path, p: Point, warmup_seq: int = 8) -> dict[str, tuple[int, int]]:
    """Exact live tensor bytes per phase over two optimizer steps (accumulation 1, then 2).

    Step 1 and micro-step 2.1 run on `warmup_seq` tokens: they only create the optimizer states and the gradients
    that micro-step 2.2 (the full `p.seq`) accumulates into, which are the same size at any sequence length — so the
    steady-state peak (weights + states + gradients + activations + loss) is measured with one full-size pass, which
    is what keeps the grid affordable on a shared CPU (bf16 matmuls run at ~1.5 GFLOP/s here).
    Returns phase → (peak within the phase, live at its end). Phases: "static" (after build and optimizer creation),
    then per micro-step `k` of step `n` "forward n.k" (backbone + fused LM head forward), "backward n.k", and per
    step "optimizer n" (clip + step + zero_grad); "peak" is the overall peak.
    """
    import torch
    from transformers import TrainingArguments
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.train.measure.peak import STEPS, PeakMemory, fused_head_loss, measured_step, trainer_optimizer
    from lowmem_ft.train.model import build_model

    recipe = recipe_for(model_dir, p)
    torch.manual_seed(0)
    model = build_model(recipe)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer.__init__ does
    model.train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim=OPTIM_NAMES[p.optimizer], use_cpu=True)
    optimizer = trainer_optimizer(model, args)
    trainable = [q for q in model.parameters() if q.requires_grad]
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    # tensors that exist now (weights, quantization state, LoRA) are found by walking the model; bitsandbytes' CPU
    # optimizer kernels are Python, and PeakMemory counts their temporaries (measure.python_cpu_kernels)
    with PeakMemory(roots=[model, optimizer.state]) as pm:
        pm.mark("static")
        lengths = [p.seq if s == (2, 2) else warmup_seq for s in STEPS]
        batches = trainer_batches(vocab, p.batch, lengths, gen)
        measured_step(pm, batches, partial(fused_head_loss, model), optimizer, trainable)
        phases = {m.label: (m.peak_bytes, m.live_bytes) for m in pm.marks}
        phases["peak"] = (pm.peak_bytes, pm.live_bytes)
    del model, base, optimizer, trainable, pm
    gc.collect()
    return phases


def _nvml_used() -> float:
    """Bytes in use on the first visible GPU, all processes and non-torch allocations included (NVML)."""
    import os

    import pynvml

    pynvml.nvmlInit()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    index = int(visible) if visible.isdigit() else 0
    return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)


def _cuda_sample(before: float) -> dict[str, float]:
    """Allocator figures now and their peaks since the last reset, and NVML device use minus `before`."""
    import torch

    torch.cuda.synchronize()
    sample = {
        "peak_allocated": float(torch.cuda.max_memory_allocated()),
        "peak_reserved": float(torch.cuda.max_memory_reserved()),
        "allocated": float(torch.cuda.memory_allocated()),
        "reserved": float(torch.cuda.memory_reserved()),
        "device": _nvml_used() - before,
    }
    torch.cuda.reset_peak_memory_stats()
    return sample


def measure_cuda(model_dir: Path, p: Point, vram_gb: float | None = None) -> dict[str, Any]:
    """The same two optimizer steps on the CUDA device, full size, under the `--vram` cap, measured three ways.

    `allocated` (torch.cuda.max_memory_allocated) is the live tensor bytes the model predicts without overheads;
    `reserved` (max_memory_reserved) adds the caching allocator's rounding and fragmentation; `device` (NVML used
    minus what was used before the model, sampled after each phase) adds the CUDA context and cuBLAS workspaces.
    Returns those peaks in bytes plus `exact` (PeakMemory's live bytes) for the CPU-style comparison, and `phases`:
    label → `_cuda_sample` taken at the end of each phase ("static" after the build, then "forward n.k",
    "backward n.k", "optimizer n" as `measure` labels them), each with the allocator's peaks within that phase.
    """
    import torch
    from transformers import TrainingArguments
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.train.device import cap_process_memory
    from lowmem_ft.train.measure.peak import PeakMemory, trainer_optimizer
    from lowmem_ft.train.model import build_model

    before = _nvml_used()  # other processes, before this one creates its CUDA context
    cap_process_memory(vram_gb)
    recipe = recipe_for(model_dir, p)
    torch.manual_seed(0)
    model = build_model(recipe)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
    model.train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim=OPTIM_NAMES[p.optimizer])
    optimizer = trainer_optimizer(model, args)
    trainable = [q for q in model.parameters() if q.requires_grad]
    vocab = base.config.vocab_size
    torch.cuda.reset_peak_memory_stats()
    phases = {"static": _cuda_sample(before)}
    with PeakMemory(device="cuda") as pm:
        steps = ((1, 1), (2, 1), (2, 2))
        batches = trainer_batches(vocab, p.batch, [p.seq] * len(steps), device="cuda")
        for (step, micro), (ids, mask, labels) in zip(steps, batches, strict=True):
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)
            phases[f"forward {step}.{micro}"] = _cuda_sample(before)
            loss.backward()
            del out, loss
            phases[f"backward {step}.{micro}"] = _cuda_sample(before)
            if micro == step:
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                phases[f"optimizer {step}"] = _cuda_sample(before)
        result = {
            "exact": float(pm.peak_bytes),
            "allocated": max(s["peak_allocated"] for s in phases.values()),
            "reserved": max(s["peak_reserved"] for s in phases.values()),
            "device": max(s["device"] for s in phases.values()),
            "phases": phases,
        }
    del model, base, optimizer, trainable, pm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def predict(model_dir: Path, p: Point, device: str = "cpu") -> Estimate:
    recipe = recipe_for(model_dir, p)
    config = json.loads((model_dir / "lowmem_config.json").read_text())
    arch = Architecture.from_config(config, name=p.arch)
    # on the CPU there are no device overheads, and quantization/activations/loss terms take their CPU forms
    return estimate(arch, setup_from_recipe(recipe, device=device))


def run_point(model_dir: Path, p: Point) -> Point:
    p.phases = measure(model_dir, p)
    p.measured = p.phases["peak"][0]
    est = predict(model_dir, p)
    p.predicted = est.steady_peak_bytes  # micro-step 2.2 accumulates into the gradients
    p.predicted_phases = est.phases
    return p


# -- the accuracy tables of devkit/bench/estimator.py and devkit/bench/long_context.py ---------------------
TABLE_PHASES = ("static", "forward", "backward", "optimizer step")
TARGETS = "(targets: median ≤ 3 %, max ≤ 8 %)"


def phase_measurements(p) -> dict[str, int]:
    """Measured peak per phase of a point's steady-state step (micro-step 2.2: states and accumulated gradients
    exist); `p` a `Point` or a `LongPoint` that ran (`run_point`)."""
    ph = p.phases
    return {
        "static": ph["backward 2.1"][1],  # weights + states + gradients, nothing in flight
        "forward": ph["forward 2.2"][0],
        "backward": ph["backward 2.2"][0],
        "optimizer step": ph["optimizer 2"][0],
    }


def phase_cells(measured: dict[str, int], predicted: dict[str, float], digits: int = 1) -> str:
    """`measured / predicted` MB per phase, as the tables' phase columns."""
    return " | ".join(f"{measured[k] / 1e6:.{digits}f} / {predicted[k] / 1e6:.{digits}f}" for k in TABLE_PHASES)


def write_accuracy_table(columns: list[str], rows: list[str], errors: list[float], out: str | None) -> str:
    """Print the summary (median and max |error|) and, with `out`, write the table: `columns` (the point's own,
    before the phase and peak columns), one row per point."""
    abs_err = [abs(e) for e in errors]
    summary = (
        f"median |error| {statistics.median(abs_err):.1%}, max |error| {max(abs_err):.1%} over {len(errors)} points"
    )
    header = [*columns, "static MB", "forward MB", "backward MB", "step MB", "peak measured MB",
              "peak predicted MB", "error"]  # fmt: skip
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *rows])
    print(summary)
    if out:
        note = "Phase cells: measured / predicted peak live MB (micro-step 2.2 and step 2)."
        Path(out).write_text(f"{note}\n\n{table}\n\n{summary} {TARGETS}\n", encoding="utf-8")
    return summary
