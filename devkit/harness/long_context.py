"""The long-context memory terms against exact CPU measurement: real training steps with the long-context knobs on.

The harness pattern of `devkit/harness/estimator.py` (build through `build_model`, two optimizer steps, the
second with gradient accumulation 2, `PeakMemory` per phase), extended to the knobs that file's recipes cannot set:
`memory.tiled_mlp` / `mlp_tile_tokens`, `memory.embeddings_on_host`, `memory.chunked_loss` with
`memory.loss_chunk_tokens` (installed as `train` installs it: `install_loss_head(chunked=True, chunk_tokens=...)`),
and sequences of thousands of tokens on narrow models, where the per-token terms of the tiled MLP decide the peak.
Used by `devkit/bench/long_context.py` (the table) and `tests/devkit/test_harness_long_context.py`.
"""

from __future__ import annotations

import gc
import json
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from devkit.harness.estimator import trainer_batches, write_model  # noqa: F401 (write_model: this module's API too)
from lowmem_ft.choosing import setup_from_recipe
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import Estimate, estimate
from lowmem_ft.recipe.load import resolve

OPTIM = {"adamw_torch": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit"}  # recipe name → TrainingArguments optim


@dataclass
class LongPoint:
    arch: str
    adapter: str  # lora | qlora
    checkpointing: bool
    seq: int
    batch: int = 1
    tiled_mlp: bool = False
    tile_tokens: int = 0  # 0: automatic (hidden_size)
    host_embeddings: bool = False
    chunked_loss: bool = True
    loss_chunk_tokens: int = 0  # 0: automatic
    optimizer: str = "adamw_torch"
    dropout: float = 0.05
    recompute_lora: bool = False
    tiled_norms: bool = False
    measured: int = 0
    predicted: float = 0.0
    phases: dict[str, tuple[int, int]] = field(default_factory=dict)
    predicted_phases: dict[str, float] = field(default_factory=dict)

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    def knobs(self) -> str:
        knobs = (
            ("tiled", self.tiled_mlp),
            ("tiled-norms", self.tiled_norms),
            ("lora-recompute", self.recompute_lora),
            ("host-emb", self.host_embeddings),
        )
        on = [k for k, v in knobs if v]
        on.append(f"chunk {self.loss_chunk_tokens or 'auto'}" if self.chunked_loss else "trl-loss")
        return ", ".join(on)


def recipe_for(model_dir: Path, p: LongPoint):
    overrides = {
        "model": {"name_or_path": str(model_dir), "quantization": "nf4" if p.adapter == "qlora" else "none"},
        "adapter": {"kind": "lora", "r": 8, "dropout": p.dropout},
        "optimizer": {"name": p.optimizer},
        "memory": {
            "gradient_checkpointing": p.checkpointing,
            "micro_batch_size": p.batch,
            "max_seq_len": p.seq,
            "tiled_mlp": p.tiled_mlp,
            "mlp_tile_tokens": p.tile_tokens,
            "recompute_lora": p.recompute_lora,
            "tiled_norms": p.tiled_norms,
            "embeddings_on_host": p.host_embeddings,
            "chunked_loss": p.chunked_loss,
            "loss_chunk_tokens": p.loss_chunk_tokens,
            "gradient_accumulation": 1,  # each micro batch is let go before the next (trainer_batches)
        },
    }
    return resolve(None, overrides)


def _loss_head(model, p: LongPoint) -> None:
    """The loss `train` installs: TRL's fused head (SFTTrainer.__init__), replaced by ours when chunked."""
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.train.losses import install_loss_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
    if p.chunked_loss:
        install_loss_head(model, chunked=True, chunk_tokens=p.loss_chunk_tokens or None)


def _host_table_bytes(model) -> int:
    """Bytes of the input embedding table `embeddings_on_host` keeps in host memory."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weight = base.get_input_embeddings().weight
    assert getattr(base.get_input_embeddings(), "_lowmem_on_host", False), "embeddings_on_host was not applied"
    return weight.untyped_storage().nbytes()


def measure(model_dir: Path, p: LongPoint, warmup_seq: int = 8) -> dict[str, tuple[int, int]]:
    """Exact live tensor bytes per phase over two optimizer steps (accumulation 1, then 2); the full `p.seq` runs in
    micro-step 2.2 only (see `harness.estimator.measure` for why). Returns phase → (peak within it, live at its end)."""
    import torch
    from transformers import Trainer, TrainingArguments

    from lowmem_ft.train.measure.peak import STEPS, PeakMemory, fused_head_loss, measured_step
    from lowmem_ft.train.model import build_model

    recipe = recipe_for(model_dir, p)
    torch.manual_seed(0)
    model = build_model(recipe)
    _loss_head(model, p)
    model.train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim=OPTIM[p.optimizer], use_cpu=True)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    trainable = [q for q in model.parameters() if q.requires_grad]
    optimizer = cls(trainable, **kwargs)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    with PeakMemory() as pm:  # bitsandbytes' Python CPU optimizer kernels run under its mode (python_cpu_kernels)
        pm.mark("static")
        lengths = [p.seq if s == (2, 2) else warmup_seq for s in STEPS]
        batches = trainer_batches(vocab, p.batch, lengths, gen)
        measured_step(pm, batches, partial(fused_head_loss, model), optimizer, trainable)
        # With host embeddings the table lives in host memory; on this CPU-only yardstick host and device are one
        # memory, so the table's bytes (alive throughout, nothing else on the host) are taken out of every figure.
        host = _host_table_bytes(model) if p.host_embeddings else 0
        phases = {m.label: (m.peak_bytes - host, m.live_bytes - host) for m in pm.marks}
        phases["peak"] = (pm.peak_bytes - host, pm.live_bytes - host)
    del model, optimizer, trainable, pm
    gc.collect()
    return phases


def predict(model_dir: Path, p: LongPoint) -> Estimate:
    config = json.loads((model_dir / "lowmem_config.json").read_text())
    arch = Architecture.from_config(config, name=p.arch)
    return estimate(arch, setup_from_recipe(recipe_for(model_dir, p), device="cpu"))


def run_point(model_dir: Path, p: LongPoint) -> LongPoint:
    p.phases = measure(model_dir, p)
    p.measured = p.phases["peak"][0]
    est = predict(model_dir, p)
    p.predicted = est.steady_peak_bytes  # micro-step 2.2 accumulates into the gradients
    p.predicted_phases = est.phases
    return p
