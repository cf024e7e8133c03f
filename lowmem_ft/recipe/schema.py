"""The recipe schema: one typed dataclass per section, whose field help is the documentation.

A recipe is everything a run needs besides the machine: which model and data, how the model is stored and
adapted, which optimizer, how memory is spent, how long to train and where to log. YAML files only fill these
dataclasses in (see `lowmem_ft.recipe.load`); `lowmem-ft recipes show NAME` prints them resolved.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

Quantization = Literal["nf4", "int8", "none"]
DType = Literal["bfloat16", "float16", "float32"]
Attention = Literal["sdpa", "eager", "flash_attention_2"]
AdapterKind = Literal["lora", "full"]
OptimizerName = Literal["adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor"]
Schedule = Literal["cosine", "linear", "constant", "constant_with_warmup"]
DataFormat = Literal["auto", "text", "prompt_completion", "messages", "sharegpt", "alpaca"]
Truncate = Literal["keep_start", "keep_end", "drop", "chunk"]
WandbMode = Literal["online", "offline", "disabled", "auto"]


def _f(default, help: str, **kw):
    """A dataclass field whose `help` is its documentation (printed by `recipes show --help-keys`)."""
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelSection:
    name_or_path: str = _f("", "Hub id (e.g. Qwen/Qwen2.5-7B) or local directory of the base model. `--model` sets it.")
    quantization: Quantization = _f(
        "nf4", "How base weights are stored: nf4 (QLoRA 4-bit), int8 (LLM.int8), none (16-bit)."
    )
    double_quant: bool = _f(True, "NF4 only: quantize the quantization constants too (saves ~0.37 bit/param).")
    compute_dtype: DType = _f(
        "bfloat16", "dtype of matmuls and of the unquantized modules (embeddings, lm_head, norms)."
    )
    attn_implementation: Attention = _f(
        "sdpa", "Attention kernel: sdpa (memory-efficient), flash_attention_2, eager (s² scores)."
    )
    trust_remote_code: bool = _f(False, "Run the model repository's own Python code. Off unless you trust the repo.")


@dataclass
class AdapterSection:
    kind: AdapterKind = _f(
        "lora", "lora: train low-rank adapters on a frozen base; full: train every weight (no quantization)."
    )
    r: int = _f(16, "LoRA rank.")
    alpha: int = _f(32, "LoRA alpha (scaling = alpha / r).")
    dropout: float = _f(0.05, "Dropout on the LoRA input.")
    target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names that get adapters; ['all-linear'] targets every linear layer but the output head.",
    )


@dataclass
class OptimizerSection:
    name: OptimizerName = _f(
        "paged_adamw_8bit",
        "Optimizer: adamw_torch (fp32 states, 8 B/param), adamw_8bit / paged_adamw_8bit (bitsandbytes, ~2 B/param), paged_adamw_32bit, adafactor.",
    )
    lr: float = _f(2e-4, "Peak learning rate.")
    weight_decay: float = _f(0.0, "Weight decay.")
    schedule: Schedule = _f("cosine", "Learning-rate schedule after warmup.")
    warmup_ratio: float = _f(0.03, "Fraction of the optimizer steps spent warming up.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0 disables).")


@dataclass
class MemorySection:
    gradient_checkpointing: bool = _f(
        True, "Recompute layer activations in backward (non-reentrant) instead of keeping them."
    )
    micro_batch_size: int = _f(1, "Samples per forward/backward on one device.")
    gradient_accumulation: int = _f(
        8, "Micro batches per optimizer step (effective batch = micro_batch_size × this × GPUs)."
    )
    max_seq_len: int = _f(1024, "Longest sequence in tokens; longer samples follow data.truncate.")
    safety_margin_gb: float = _f(1.0, "VRAM kept free below the target, for the allocator and for spikes.")
    activation_offloading: bool = _f(
        False,
        "Keep the checkpointed layer inputs in pinned host memory (transformers' offload=True, torch save_on_cpu); "
        "needs gradient_checkpointing.",
    )
    chunked_loss: bool = _f(
        False,
        "Compute the loss in token chunks, recomputing each chunk's logits in backward, instead of over full fp32 "
        "logits (lowmem_ft.train.losses).",
    )
    eval_batch_size: int = _f(
        0,
        "Samples per evaluation forward; 0 = automatic (the planner's choice under --vram, else micro_batch_size). Eval keeps no "
        "gradients or optimizer states, but its logits are a peak of their own.",
    )
    loss_chunk_tokens: int = _f(
        0,
        "chunked_loss only: tokens per loss chunk; 0 = automatic (64 MiB of fp32 logits per chunk). Larger chunks are "
        "fewer, faster matmuls and a larger loss working set (lowmem_ft.memory.estimate.largest_loss_chunk).",
    )
    tiled_mlp: bool = _f(
        False,
        "Run each decoder MLP over tiles of mlp_tile_tokens tokens, recomputed tile by tile in backward, so no "
        "(tokens × intermediate) tensor of the whole sequence exists (lowmem_ft.train.tiled_mlp); costs one more MLP "
        "forward per step.",
    )
    mlp_tile_tokens: int = _f(
        0, "Tokens per tile of tiled_mlp, tiled_norms and recompute_lora; 0 = automatic (hidden_size tokens)."
    )
    tiled_norms: bool = _f(
        False,
        "Run each hidden-size RMSNorm over token tiles, recomputed in backward, so its fp32 copy of the input and "
        "its fp32 backward temporaries exist for one tile at a time (lowmem_ft.train.tiled_mlp.tile_norms).",
    )
    recompute_lora: bool = _f(
        False,
        "Recompute each LoRA branch (input cast, dropout, lora_A) in token tiles in backward instead of keeping "
        "peft's fp32 copies of every adapted linear's input (lowmem_ft.train.lora_recompute); costs the LoRA "
        "branches' forward once more.",
    )
    embeddings_on_host: bool = _f(
        False,
        "Keep the frozen input embedding table in host memory: the lookup runs on the CPU and only the gathered rows "
        "move to the device (untied models with LoRA only; lowmem_ft.train.host_embeddings).",
    )


@dataclass
class DataSection:
    path: str = _f("", "Training data, JSONL. `--data` sets it.")
    format: DataFormat = _f("auto", "Record shape; auto detects text, prompt/completion, messages, sharegpt, alpaca.")
    train_on_prompt: bool = _f(
        False, "Also compute the loss on prompt / user tokens (default: completion / assistant only)."
    )
    truncate: Truncate = _f("keep_start", "What happens to samples longer than memory.max_seq_len.")
    overlap: int = _f(128, "Tokens shared by consecutive chunks when truncate is chunk.")
    packing: bool = _f(False, "Pack several samples into one max_seq_len sequence (no attention across samples).")
    skip_bad_lines: bool = _f(False, "Skip malformed lines (and report them) instead of stopping.")
    eval_path: str = _f("", "Evaluation data, JSONL (default: none, or eval_fraction of the training data).")
    eval_fraction: float = _f(0.0, "Fraction of the training data held out for evaluation when eval_path is empty.")


@dataclass
class TrainingSection:
    epochs: float = _f(1.0, "Passes over the data (ignored when max_steps > 0).")
    max_steps: int = _f(-1, "Optimizer steps to run; -1 runs `epochs` passes.")
    seed: int = _f(42, "Seed for data order and adapter initialization.")
    logging_steps: int = _f(10, "Log loss every N optimizer steps.")
    save_steps: int = _f(200, "Save a resumable checkpoint every N optimizer steps.")
    save_total_limit: int = _f(2, "Checkpoints kept on disk.")
    eval_steps: int = _f(200, "Evaluate every N optimizer steps when there is eval data.")
    output_dir: str = _f("runs", "Parent directory of run directories.")


@dataclass
class LoggingSection:
    wandb_project: str = _f("lowmem-ft", "Weights & Biases project.")
    wandb_mode: WandbMode = _f("auto", "online, offline, disabled, or auto (online when logged in, offline otherwise).")


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    adapter: AdapterSection = field(default_factory=AdapterSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    memory: MemorySection = field(default_factory=MemorySection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    logging: LoggingSection = field(default_factory=LoggingSection)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Recipe)}  # type: ignore[misc]
