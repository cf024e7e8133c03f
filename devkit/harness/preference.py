"""A preference step's memory, measured: TRL's own trainers' step under the exact CPU count, beside the memory model.

One point = a zoo family at the accuracy grid's width (`devkit.zoo.estimator_config`, bf16 weights on disk, the
family's tokenizer and chat template) trained by the `train` path itself: `lowmem_ft.train.run.FineTune` builds the
recipe's data (the pairs tokenized and fitted), model (LoRA, QLoRA or full), TRL trainer (`DPOTrainer` with the
recipe's `loss_type` and reference, the experimental `ORPOTrainer` / `CPOTrainer`, `KTOTrainer`) and optimizer, as
a run does. Then two optimizer steps (`lowmem_ft.train.measure.peak.measured_step`: accumulation 1, then 2) run the
trainer's `compute_loss` (its reference pass, KTO's KL batch and the method's loss included) and backward on
micro batches its own collator made, under `PeakMemory` (exact live tensor bytes). Step 1 and micro-step 2.1 run on
short pairs (they only create the optimizer states and the gradients micro-step 2.2 accumulates into); micro-step
2.2 runs full-length pairs.

The prediction is what a CPU run's monitor compares with (`lowmem_ft.train.measure.exact.ExactMemory.phase_bytes`): the
memory model's CPU form for the recipe, the method and its reference, at the rows × tokens the policy's forward
ran. Used by `devkit/bench/estimator_preference.py` (the table) and `tests/devkit/test_harness_preference.py`.
"""

from __future__ import annotations

import gc
import json
import random
import tempfile
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from devkit.harness.estimator import TABLE_PHASES

MODEL_FORWARD = "model forward"  # the mark at the end of each forward of the trained module, as the monitor samples
# words of the zoo tokenizers' training corpus: each is one or two tokens for every family
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "to", "sun", "moon", "star", "tree", "river",
         "water", "fire", "earth", "sky", "blue", "green", "red")  # fmt: skip


@dataclass
class PrefPoint:
    family: str
    method: str  # dpo | orpo | simpo | kto
    adapter: str  # full | lora | qlora
    checkpointing: bool
    pairs: int  # pairs (KTO: completions) per micro batch
    seq: int  # tokens of the longest row of the full micro batch
    loss_type: str = "sigmoid"  # DPO's
    reference: str = "auto"  # DPO/KTO full fine-tuning: copy | precomputed
    optimizer: str = "adamw_torch"
    batch: tuple[int, int] = (0, 0)  # rows × tokens the policy's forward ran in micro-step 2.2
    marks: list[tuple[str, int, int]] = field(default_factory=list)  # (label, peak since the last, live), in order
    predicted_phases: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        what = f"dpo/{self.loss_type}" if self.method == "dpo" else self.method
        ref = f" ref {self.reference}" if self.adapter == "full" and self.method in ("dpo", "kto") else ""
        return f"{self.family} {what} {self.adapter}{ref} ckpt {'on' if self.checkpointing else 'off'}"

    def measured(self) -> dict[str, int]:
        """The steady-state step's phase peaks (micro-step 2.2, step 2), in the windows a run's monitor samples
        (`lowmem_ft.train.observe.monitor`): "forward" ends with each forward of the model — the policy's, and the no-grad
        ones of the same module inside the step (DPO's reference with the adapter disabled, KTO's KL batch) —
        "backward" runs from the last of them through the loss and its backward (ORPO / SimPO's loss, computed
        outside the forward, falls there), "optimizer step" is the step. Static: live after micro-step 2.1."""
        labels = [label for label, _, _ in self.marks]
        start, end = labels.index("backward 2.1"), labels.index("forward 2.2")
        peak = {label: peak for label, peak, _ in self.marks}
        return {
            "static": self.marks[start][2],
            "forward": max(p for label, p, _ in self.marks[start + 1 : end] if label == MODEL_FORWARD),
            "backward": max(peak["forward 2.2"], peak["backward 2.2"]),
            "optimizer step": peak["optimizer 2"],
        }

    def errors(self) -> dict[str, float]:
        """Per phase of the steady-state step: (predicted − measured) / measured."""
        measured = self.measured()
        return {k: (self.predicted_phases[k] - measured[k]) / measured[k] for k in TABLE_PHASES}


def write_family(name: str, out: Path, seed: int = 0) -> Path:
    """Zoo family `name` at the grid's width (`estimator_config`), random bf16 weights, with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from devkit import zoo

    family = zoo.FAMILIES[name]
    tokenizer = zoo.build_tokenizer(family)
    shape = {k: v for k, v in zoo.estimator_config(name).items() if k != "pad_token_id"}  # the tokenizer's pad
    config = zoo.config_for(replace(family, config=shape), tokenizer)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def write_data(method: str, pairs: int, seq: int, out: Path) -> Path:
    """`pairs` short records (the warm-up micro batch), then `pairs` records longer than `seq` tokens (fitted to it
    by the data path: prompt kept, answers cut), as JSONL of plain strings; KTO's with labels True and False."""
    rng = random.Random(0)
    rows = []
    for long in (False, True):
        for i in range(pairs):
            prompt = _text(rng, 6)
            n = seq if long else 3
            if method == "kto":
                rows.append({"prompt": prompt, "completion": _text(rng, n), "label": i % 2 == 0})
            else:  # the rejected answer shorter: its rows are padded, as real pairs' are
                rows.append({"prompt": prompt, "chosen": _text(rng, n), "rejected": _text(rng, max(2, n // 2))})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


def recipe_sets(model_dir: Path, data: Path, out: Path, p: PrefPoint) -> list[str]:
    return [
        f"model.name_or_path={model_dir}",
        f"model.quantization={'nf4' if p.adapter == 'qlora' else 'none'}",
        f"adapter.kind={'full' if p.adapter == 'full' else 'lora'}",
        "adapter.r=8",
        f"data.path={data}",
        "data.eval_fraction=0",
        f"training.output_dir={out}",
        f"training.method={p.method}",
        "training.max_steps=2",
        f"preference.loss_type={p.loss_type}",
        f"preference.reference={p.reference}",
        f"optimizer.name={p.optimizer}",
        f"memory.gradient_checkpointing={str(p.checkpointing).lower()}",
        f"memory.micro_batch_size={p.pairs}",
        f"memory.max_seq_len={p.seq}",
        "memory.gradient_accumulation=1",  # each micro batch is let go before the next, as trainer_batches says
        "logging.wandb_mode=disabled",
    ]


def _collated(trainer, rows: list[list[dict[str, Any]]]):
    """The micro batches of `rows` as the trainer's collator makes them, one made ahead of the one that runs
    (accelerate's loader iterates one ahead on the CPU: the memory model's batch term counts it)."""
    ahead = [trainer._prepare_inputs(trainer.data_collator(rows[0]))]
    for i in range(len(rows)):
        ahead.append(trainer._prepare_inputs(trainer.data_collator(rows[min(i + 1, len(rows) - 1)])))
        yield ahead.pop(0)


def measure(model_dir: Path, p: PrefPoint, work: Path) -> PrefPoint:
    """Run point `p` (see the module docstring); fills `p.batch`, `p.marks` and `p.predicted_phases`."""
    import bitsandbytes
    import torch

    from lowmem_ft.choosing import Choice
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train.measure.peak import STEPS, PeakMemory, measured_step
    from lowmem_ft.train.run import FineTune

    data = write_data(p.method, p.pairs, p.seq, work / f"{p.method}.jsonl")
    recipe = resolve(None, recipe_sets(model_dir, data, work / "runs", p))
    bitsandbytes.optim.GlobalOptimManager.get_instance().initialize()  # no earlier point's embedding overrides
    job = FineTune(recipe, RunDir.new(work / "runs", "grid", str(model_dir)), Choice("recipe", "grid")).build()
    trainer, model = job.trainer, job.trainer.model
    optimizer = trainer.create_optimizer()
    trainable = [q for q in model.parameters() if q.requires_grad]
    dataset = trainer.train_dataset  # after TRL's preparation: KTO's KL completions, precomputed reference log-probs
    short = [dataset[i] for i in range(p.pairs)]
    full = [dataset[i] for i in range(p.pairs, 2 * p.pairs)]
    shapes: list[tuple[int, int]] = []

    def policy_forward(module, args, kwargs):  # the policy's (grad-enabled) forward: the batch the model is given
        ids = kwargs.get("input_ids", args[0] if args else None)
        if module.training and torch.is_grad_enabled() and ids is not None:
            shapes.append((int(ids.shape[0]), int(ids.shape[1])))

    model.train()
    reference = getattr(trainer, "ref_model", None)
    roots = [model, optimizer.state] + ([reference] if reference is not None else [])
    hooks = [model.register_forward_pre_hook(policy_forward, with_kwargs=True)]
    try:
        with PeakMemory(device="cpu", roots=roots) as pm:
            # the monitor's forward sample (MemoryMonitor.attach): the end of every training forward of the module
            hooks.append(model.register_forward_hook(partial(_mark_forward, pm)))
            pm.mark("static")
            batches = _collated(trainer, [full if s == (2, 2) else short for s in STEPS])
            forward = partial(_loss, trainer, model)
            measured_step(pm, batches, forward, optimizer, trainable, recipe.optimizer.max_grad_norm or 1.0)
            p.marks = [(m.label, m.peak_bytes, m.live_bytes) for m in pm.marks]
    finally:
        for hook in hooks:
            hook.remove()
        job.run.unlock()
    p.batch = shapes[-1]
    exact = job.monitor.exact
    p.predicted_phases = {phase: exact.phase_bytes(phase, p.batch) for phase in TABLE_PHASES}
    del job, trainer, model, optimizer, trainable, reference, roots, pm
    gc.collect()
    return p


def _mark_forward(pm, module, *_) -> None:
    if module.training:
        pm.mark(MODEL_FORWARD)


def _loss(trainer, model, batch):
    """The trainer's own loss for one micro batch (what its `training_step` backs up)."""
    return trainer.compute_loss(model, batch), None


def run_points(points: list[PrefPoint], families: dict[str, Path] | None = None, progress=print) -> list[PrefPoint]:
    """Measure `points`, building each family once (under a temporary directory unless `families` gives them)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        built = dict(families or {})
        for i, p in enumerate(points):
            if p.family not in built:
                built[p.family] = write_family(p.family, root / p.family)
            work = root / f"point{i}"
            work.mkdir()
            measure(built[p.family], p, work)
            progress(p)
    return points
