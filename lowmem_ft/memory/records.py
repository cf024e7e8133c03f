"""The memory model's records: the `Setup` of knobs that change memory, a named `Component` of the peak, the
`Estimate` they make; bytes per dtype and the decimal GB lowmem-ft speaks; the setup as it runs on an architecture.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from lowmem_ft.memory.arch import Architecture

GB = 1e9  # lowmem-ft speaks decimal GB, as `--vram 24` does


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# "trl_fused_logps": TRL's fused head asked for log-probs and entropy only (GRPOTrainer), not SFTTrainer's is_top1
LossImpl = Literal["trl_fused", "trl_fused_logps", "hf_full", "chunked"]


Device = Literal["cuda", "cpu"]
# The CUDA caching allocator's setting a run uses (`lowmem_ft.cuda_alloc`): `expandable_segments:True`, what `train`
# sets unless the user set PYTORCH_CUDA_ALLOC_CONF, or torch's default settings
AllocatorSetting = Literal["expandable segments", "default"]


@dataclass(frozen=True)
class Setup:
    """The knobs that change memory, independent of the recipe dataclasses (`lowmem_ft.choosing.setup_from_recipe`)."""

    quantization: Literal["nf4", "int8", "none"] = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    adapter: Literal["lora", "full"] = "lora"
    lora_r: int = 16
    lora_dropout: float = 0.05
    use_dora: bool = False  # adapter.use_dora (lowmem_ft.memory.dora)
    adapter_init: str = "default"  # adapter.init: pissa / olora decompose each weight at start-up (memory.adapter_init)
    # LoRA's weights run in the compute dtype, not peft's fp32 (FSDP's 16-bit mixed precision gathers them so:
    # `sharding.lora_in_compute_dtype`), and peft's LoRA branches compute in it (`linears.lora_bytes`)
    lora_in_compute_dtype: bool = False
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    optimizer: str = "paged_adamw_8bit"
    gradient_checkpointing: bool = True
    micro_batch_size: int = 1
    max_seq_len: int = 1024
    gradient_accumulation: int = 8  # micro batches per optimizer step (their batch tensors are held together); the
    # recipe schema's default (memory.gradient_accumulation)
    activation_offloading: bool = False
    loss_impl: LossImpl = "trl_fused"
    loss_chunk_tokens: int | None = None  # memory.chunked_loss: tokens per chunk (None: as losses.py sizes them)
    # labelled positions of a micro batch (labels ≠ -100 after the shift), what the chunked loss projects
    # (`loss_positions`); None: every position, the upper bound a plan keeps (it does not know the batches' labels)
    loss_tokens: int | None = None
    tiled_mlp: bool = False  # memory.tiled_mlp (lowmem_ft/train/savers/tiles.py)
    mlp_tile_tokens: int = 0  # tokens per MLP tile; 0: hidden_size (tiled_mlp.mlp_tile_tokens)
    embeddings_on_host: bool = False  # memory.embeddings_on_host (lowmem_ft/train/savers/host_embeddings.py)
    recompute_lora: bool = False  # memory.recompute_lora (lowmem_ft/train/savers/lora_recompute.py)
    tiled_norms: bool = False  # memory.tiled_norms (lowmem_ft/train/savers/tiles.py tile_norms)
    # image chats (`lowmem_ft.memory.vision`): the vision tower's patches (pixel-value rows on the Qwen-VL towers) of one sample, its
    # images at the resolution cap (the data's most; without data one image at the cap); 0: text only
    image_patches: int = 0
    # ... of the micro batch as it ran (the CPU monitor's batch); None: micro_batch_size × image_patches
    batch_patches: int | None = None
    vision_train: Literal["frozen", "lora", "full"] = "frozen"  # vision.train
    device: Device = "cuda"
    allocator: AllocatorSetting = "expandable segments"  # on CUDA: the caching allocator's setting (no recipe key)
    safety_margin_gb: float = 1.0

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.max_seq_len

    @property
    def patches(self) -> int:
        """The tower's patches of one micro batch: every image (or crop) of its samples."""
        return self.micro_batch_size * self.image_patches if self.batch_patches is None else self.batch_patches


@dataclass
class Component:
    name: str
    bytes: float
    phase: Literal["static", "forward/backward", "optimizer step", "overhead", "host", "start-up"]
    source: str

    @property
    def gb(self) -> float:
        return self.bytes / GB


@dataclass
class Estimate:
    components: list[Component]
    setup: Setup
    model_peak_bytes: float  # live tensor bytes at the peak: what PeakMemory measures
    overhead_bytes: float  # CUDA context, workspaces, allocator (0 on the CPU)
    peak_phase: str
    notes: list[str] = field(default_factory=list)
    # live tensor bytes at each phase's peak (no overheads), every static component alive: the steady state of a
    # step that accumulates several micro batches
    phases: dict[str, float] = field(default_factory=dict)
    # the forward's and the backward's peaks in the first micro batch of an optimizer step, begun without gradients
    # (the Trainer's zero_grad set them to None); with one micro batch per step, every micro batch's
    first_micro_batch: dict[str, float] = field(default_factory=dict)
    # the size of the blocks the allocator's term counts (`overheads.allocator_block`; on the CPU, which has no
    # allocator term, it is computed as for CUDA and unused)
    allocator_block: float = 0.0

    @property
    def peak_bytes(self) -> float:
        return self.model_peak_bytes + self.overhead_bytes

    @property
    def steady_peak_bytes(self) -> float:
        """The peak with every static component alive in every phase (`phases`): a micro batch after the first of
        an accumulating step. `model_peak_bytes` is this with several micro batches per step; with one, lower by
        what the first micro batch lacks (`first_micro_batch`)."""
        return max(self.phases.get(p, self.model_peak_bytes) for p in ("forward", "backward", "optimizer step"))

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB

    @property
    def startup_peak_gb(self) -> float | None:
        """The start-up moment of a decomposing adapter init with the device overheads, or None without one
        (lowmem_ft.memory.adapter_init): beside the step's peak, which it does not change."""
        at = self.phases.get("start-up")
        return None if at is None else (at + self.overhead_bytes) / GB

    def by_name(self) -> dict[str, float]:
        return {c.name: c.bytes for c in self.components}

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted_peak_gb": round(self.peak_gb, 3),
            "model_peak_gb": round(self.model_peak_bytes / GB, 3),
            "overhead_gb": round(self.overhead_bytes / GB, 3),
            "peak_phase": self.peak_phase,
            # adapter.init pissa / olora only (memory.adapter_init)
            **({} if self.startup_peak_gb is None else {"startup_peak_gb": round(self.startup_peak_gb, 3)}),
            "components": [
                {"name": c.name, "gb": round(c.gb, 4), "phase": c.phase, "source": c.source} for c in self.components
            ],
            "setup": asdict(self.setup),
        }


def mlp_tile_tokens(arch: Architecture, s: Setup) -> int:
    """Tokens per MLP tile (lowmem_ft/train/savers/tiles.py mlp_tile_tokens: 0 means hidden_size), at most all tokens."""
    return min(s.tokens, s.mlp_tile_tokens or arch.hidden_size)


def effective_setup(arch: Architecture, s: Setup) -> tuple[Setup, str | None]:
    """The setup as it runs on this architecture: the attention implementation the family supports when
    transformers refuses the requested one (`Architecture.attention_for`, applied at load by
    `lowmem_ft.train.model.attention`), and why it changed (None when it did not)."""
    used, why = arch.attention_for(s.attn_implementation)
    return (s if used == s.attn_implementation else replace(s, attn_implementation=used)), why
