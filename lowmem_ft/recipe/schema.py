"""The recipe schema: one typed dataclass per section, whose fields are the one declaration of each recipe key.

A recipe is everything a run needs besides the machine: which model and data, how the model is stored and
adapted, which optimizer, how memory is spent, how long to train and where to log. YAML files only fill these
dataclasses in (see `lowmem_ft.recipe.load`); `lowmem-ft recipes show NAME` prints them resolved.

The one idea: a key is declared once, here — its type, default, range and help, and where it has them its
command-line flag (`Flag`: `--seq-len` is `--set memory.max_seq_len=…`) and the planner knob it feeds (`Planned`:
a `Setup` field of the memory model). Everything else is derived from `KEYS`: the defaults (the shipped YAML files
restate none), the flags of `train` and `plan` and the origin their errors name (`lowmem_ft.commands.flags`), and
recipe ⇄ `Setup` ⇄ plan (`lowmem_ft.choosing`).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal

Quantization = Literal["nf4", "int8", "none"]
DType = Literal["bfloat16", "float16", "float32"]
Attention = Literal["sdpa", "eager", "flash_attention_2"]
AdapterKind = Literal["lora", "full"]
VisionTrain = Literal["frozen", "lora", "full"]
OptimizerName = Literal["adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor"]
Schedule = Literal["cosine", "linear", "constant", "constant_with_warmup"]
DataFormat = Literal["auto", "text", "prompt_completion", "chat_prompt_completion", "messages", "sharegpt", "alpaca"]
Truncate = Literal["keep_start", "keep_end", "drop", "chunk"]
WandbMode = Literal["online", "offline", "disabled", "auto"]
# transformers' `report_to` names of the trackers a run's recipe, plan and memory go to (lowmem_ft.train.observe.tracking).
Tracker = Literal["wandb", "tensorboard", "trackio", "none"]
MixStrategy = Literal["undersample", "oversample"]
Method = Literal["sft", "dpo", "orpo", "simpo", "kto", "grpo"]


@dataclass(frozen=True)
class MethodInputs:
    """What a training method takes from the recipe, one record per `Method` (`METHOD_INPUTS`): the record format its
    data is read in (`lowmem_ft.data.readers`), and whether its loss compares the policy with a reference model.
    How a method is planned is `lowmem_ft.method_planning`; how it trains, `lowmem_ft.train.methods`."""

    # None: SFT's data, read as data.format says; else the one format the method reads (prompts, preference, kto)
    data_format: str | None = None
    # its loss compares with a reference (TRL's DPOTrainer and KTOTrainer: for LoRA, the base with the adapter off)
    reference: bool = False
    # its trainer scores completions with reward functions (grpo.rewards, --reward-fn)
    rewards: bool = False


METHOD_INPUTS: dict[str, MethodInputs] = {
    "sft": MethodInputs(),
    "dpo": MethodInputs("preference", reference=True),
    "orpo": MethodInputs("preference"),
    "simpo": MethodInputs("preference"),
    "kto": MethodInputs("kto", reference=True),
    "grpo": MethodInputs("prompts", rewards=True),
}
# TRL 1.16 grpo_config.py `loss_type`'s supported values
GrpoLoss = Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
# TRL 1.16 dpo_config.py `loss_type`'s documented values
DpoLoss = Literal[
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip
PromptTruncation = Literal["keep_end", "keep_start", "drop"]
ReferenceModel = Literal["auto", "adapter_disabled", "copy", "precomputed"]
# The shortest max_seq_len a recipe may ask for; the planner's lengths are multiples of it (lowmem_ft.memory.planner).
MIN_SEQ_LEN = 16
# Every integer a recipe or flag gives is a count, a length, a step or a seed that torch, numpy and the Trainer hold
# as a 32-bit int somewhere (tensor sizes, step counters; numpy seeds are unsigned 32-bit); a larger one is a typo,
# refused where it enters.
INT_LIMIT = 2**31


@dataclass(frozen=True)
class Flag:
    """The command-line flag of a recipe key: `--seq-len 64` is `--set memory.max_seq_len=64` (the value read as
    `--set` reads it, a string key's as typed), and errors about the value name the flag, not `--set`.

    `help` is the flag's line in `--help` (the key is added after it) where it says less than the key's help, or
    differently; left empty, the line is the key's own help (`Key.flag_help`). `switch` makes it a flag without a
    value that sets the key to `switch` (`--no-wandb` → logging.wandb_mode=disabled); `hidden_choices` are choices of
    the key the flag does not offer (`--format auto` is what no flag means).
    """

    name: str
    help: str = ""
    metavar: str | None = None
    switch: Any = None
    hidden_choices: tuple[str, ...] = ()


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Planned:
    """The planner knob a recipe key feeds: a field of the memory model's `Setup`, or a figure the planner's request
    and plan carry beside it (`gradient_accumulation`, `eval_batch_size`), and how a value is spelled there and back
    where the two differ (a list as a tuple, a switch as a choice, 0 = automatic as None)."""

    name: str
    to_planner: Callable[[Any], Any] = _same
    from_planner: Callable[[Any], Any] = _same


def _f(default, help: str, *, flag: Flag | None = None, planner: str | Planned | None = None, **kw):
    """A dataclass field whose `help` is its documentation (`lowmem-ft recipes keys`).

    `ge` / `gt` / `lt` in `kw` declare the field's range (at least `ge`, above `gt`, below `lt`);
    `lowmem_ft.recipe.load` checks it, once, when a recipe is resolved — the one place a value is validated.
    `flag` is the key's command-line flag, `planner` the planner knob it feeds (a name: the same value there).
    """
    planned = Planned(planner) if isinstance(planner, str) else planner
    metadata = {"help": help, "flag": flag, "planner": planned, **kw}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=metadata)
    if isinstance(default, dict):
        return field(default_factory=lambda d=default: dict(d), metadata=metadata)
    return field(default=default, metadata=metadata)


def span(*, ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None) -> str:
    """A range in words, as errors and `recipes keys` say it: "at least 1", "above 0", "in [0, 1)", "in (0, 1]"."""

    def num(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    low = f"[{num(ge)}" if ge is not None else f"({num(gt)}" if gt is not None else None
    high = f"{num(le)}]" if le is not None else f"{num(lt)})" if lt is not None else None
    if low and high:
        return f"in {low}, {high}"
    if ge is not None:
        return f"at least {num(ge)}"
    if gt is not None:
        return f"above {num(gt)}"
    if le is not None:
        return f"at most {num(le)}"
    return f"below {num(lt)}" if lt is not None else "any value"


def in_range(value: float, *, ge=None, gt=None, le=None, lt=None) -> bool:
    return (
        (ge is None or value >= ge)
        and (gt is None or value > gt)
        and (le is None or value <= le)
        and (lt is None or value < lt)
    )


@dataclass
class ModelSection:
    name_or_path: str = _f(
        "",
        "Hub id (e.g. Qwen/Qwen2.5-7B) or local directory of the base model.",
        flag=Flag("--model", "hub id or local directory of the base model"),
    )
    quantization: Quantization = _f(
        "nf4", "How base weights are stored: nf4 (QLoRA 4-bit), int8 (LLM.int8), none (16-bit).", planner="quantization"
    )
    double_quant: bool = _f(
        True, "NF4 only: quantize the quantization constants too (saves ~0.37 bit/param).", planner="double_quant"
    )
    compute_dtype: DType = _f(
        "bfloat16",
        "dtype of matmuls and of the unquantized modules (embeddings, lm_head, norms).",
        planner="compute_dtype",
    )
    attn_implementation: Attention = _f(
        "sdpa",
        "Attention kernel: sdpa (memory-efficient), flash_attention_2, eager (s² scores).",
        planner="attn_implementation",
    )
    trust_remote_code: bool = _f(
        False,
        "Run the model repository's own Python code. Only the command line turns it on (--trust-remote-code or "
        "--set): a recipe file — a run directory's recipe.yaml included — cannot.",
        flag=Flag("--trust-remote-code", "allow the model repository's own code", switch=True),
    )


@dataclass
class AdapterSection:
    kind: AdapterKind = _f(
        "lora",
        "lora: train low-rank adapters on a frozen base; full: train every weight (no quantization).",
        planner="adapter",
    )
    r: int = _f(16, "LoRA rank.", ge=1, planner="lora_r")
    alpha: int = _f(32, "LoRA alpha (scaling = alpha / r).", ge=1)
    dropout: float = _f(0.05, "Dropout on the LoRA input.", ge=0.0, lt=1.0, planner="lora_dropout")
    use_dora: bool = _f(
        False,
        "DoRA: a trainable magnitude per output feature of each adapted linear on top of LoRA (peft's use_dora). "
        "Costs memory the plan counts: the magnitude vectors, their gradients and states, and each adapted linear's "
        "weight norm recomputed in every forward (lowmem_ft.memory.dora).",
        planner="use_dora",
    )
    use_rslora: bool = _f(
        False,
        "Rank-stabilized LoRA: scale the adapter by alpha / sqrt(r) instead of alpha / r (peft's use_rslora), so "
        "higher ranks keep learning. Scaling only: no memory of its own (peft lora/layer.py update_layer).",
    )
    init: str = _f(
        "default",
        "How the adapter starts (peft's init_lora_weights): default (B = 0, the adapter a no-op), gaussian, pissa "
        "(A and B from the top-r singular vectors of each adapted weight; the base keeps the residual), "
        "pissa_niter_N (the same by a randomized SVD with N subspace iterations: seconds, not minutes, on 7B), olora "
        "(A and B from a QR of each weight). pissa and olora need 16-bit weights (model.quantization=none): they "
        "rewrite the base weights, and the saved adapter is converted to a plain LoRA adapter on the original base "
        "(rank 2r). The decomposition's one-off start-up peak is in the plan (lowmem_ft.memory.adapter_init).",
        planner="adapter_init",
    )
    target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names that get adapters; ['all-linear'] targets every linear layer but the output head.",
        planner=Planned("lora_targets", tuple, list),
    )
    name_or_path: str = _f(
        "",
        "An existing LoRA adapter to continue training (a directory with adapter_config.json, or a Hub id); its r, "
        "alpha, dropout and target_modules replace this section's.",
        flag=Flag(
            "--adapter",
            "continue training this LoRA adapter (a directory, runs/NAME, or a Hub id); the plan counts its rank and "
            "target modules",
            metavar="PATH_OR_ID",
        ),
    )


@dataclass
class OptimizerSection:
    name: OptimizerName = _f(
        "paged_adamw_8bit",
        "Optimizer: adamw_torch (fp32 states, 8 B/param), adamw_8bit / paged_adamw_8bit (bitsandbytes, ~2 B/param), paged_adamw_32bit, adafactor.",
        planner="optimizer",
    )
    lr: float = _f(2e-4, "Peak learning rate.", gt=0.0, flag=Flag("--lr", "peak learning rate", metavar="LR"))
    weight_decay: float = _f(0.0, "Weight decay (decoupled, AdamW).", ge=0.0)
    schedule: Schedule = _f("cosine", "Learning-rate schedule after warmup.")
    warmup_ratio: float = _f(0.03, "Fraction of the optimizer steps spent warming up.", ge=0.0, lt=1.0)
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0 disables).", ge=0.0)
    loraplus_lr_ratio: float = _f(
        0.0,
        "LoRA+: the learning rate of the lora_B matrices is lr × this (peft's create_loraplus_optimizer; 16 is the "
        "paper's default); 0 = off. The same parameters in other param groups: no memory of its own.",
        ge=0.0,
    )


@dataclass
class MemorySection:
    gradient_checkpointing: bool = _f(
        True,
        "Recompute layer activations in backward (non-reentrant) instead of keeping them.",
        planner="gradient_checkpointing",
    )
    micro_batch_size: int = _f(1, "Samples per forward/backward on one device.", ge=1, planner="micro_batch_size")
    gradient_accumulation: int = _f(
        8,
        "Micro batches per optimizer step (effective batch = micro_batch_size × this × GPUs).",
        ge=1,
        planner="gradient_accumulation",
    )
    max_seq_len: int = _f(
        1024,
        "Longest sequence in tokens; longer samples follow data.truncate.",
        ge=MIN_SEQ_LEN,
        flag=Flag("--seq-len", "longest sequence in tokens; fixed, not sized from the data", metavar="N"),
        planner="max_seq_len",
    )
    safety_margin_gb: float = _f(
        1.0,
        "VRAM kept free below the target, for the allocator and for spikes (budget = VRAM − this).",
        ge=0.0,
        planner="safety_margin_gb",
    )
    host_ram_gb: float = _f(
        0.0,
        "Host RAM the run may keep in GB (all its processes on one machine); 0 = what this machine has available "
        "when the run is planned (psutil). Set it to plan for another machine, or to make a plan reproducible. The "
        "planner counts offloaded layer inputs, host embeddings, paged and offloaded optimizer states against it "
        "less host_margin_gb, and a plan that needs more does not fit.",
        ge=0.0,
        flag=Flag(
            "--host-ram", "host RAM the plan may use, in GB (default: what this machine has available)", metavar="GB"
        ),
    )
    host_margin_gb: float = _f(
        4.0,
        "Host RAM kept free below host_ram_gb for what the plan does not count: the Python process itself (torch, "
        "the tokenizer, the data), the loader's copy of each checkpoint shard, the OS (host budget = RAM − this).",
        ge=0.0,
    )
    activation_offloading: bool = _f(
        False,
        "Keep the checkpointed layer inputs in pinned host memory (transformers' offload=True, torch save_on_cpu); "
        "needs gradient_checkpointing.",
        planner="activation_offloading",
    )
    chunked_loss: bool = _f(
        False,
        "Compute the loss in token chunks, recomputing each chunk's logits in backward, instead of over full fp32 "
        "logits (lowmem_ft.train.losses).",
        # TRL 1.16 SFTTrainer.compute_loss always goes through the fused LM head unless a compute_loss_func is set;
        # memory.chunked_loss swaps in lowmem-ft's own chunked cross-entropy.
        planner=Planned("loss_impl", lambda on: "chunked" if on else "trl_fused", lambda impl: impl == "chunked"),
    )
    full_logits_loss: bool = _f(
        False,
        "Compute the loss as plain transformers Trainer does: the model's own cross-entropy (ForCausalLMLoss) over "
        "the full logits, upcast to fp32, instead of TRL's fused LM head. The most memory of the three losses "
        "(tokens × vocab × (2 + 12) bytes in bf16); the planner prices it and keeps it. Not with chunked_loss.",
        # lowmem_ft.train.losses.install_loss_head(chunked=False) answers SFTTrainer's loss call over full logits
        planner=Planned("loss_impl", lambda on: "hf_full" if on else "trl_fused", lambda impl: impl == "hf_full"),
    )
    eval_batch_size: int = _f(
        0,
        "Samples per evaluation forward; 0 = automatic (the planner's choice under --vram, else micro_batch_size). Eval keeps no "
        "gradients or optimizer states, but its logits are a peak of their own.",
        ge=0,
        planner="eval_batch_size",
    )
    loss_chunk_tokens: int = _f(
        0,
        "chunked_loss only: tokens per loss chunk; 0 = automatic: under --vram the planner sizes it from the budget "
        "(the largest that fits what the rest of the step leaves, at most 4,096 tokens), else 64 MiB of fp32 logits "
        "per chunk. Larger chunks are fewer, faster matmuls and a larger loss working set "
        "(lowmem_ft.memory.estimate.largest_loss_chunk).",
        ge=0,
        planner=Planned("loss_chunk_tokens", lambda n: n or None, lambda n: n or 0),  # the planner's None: automatic
    )
    tiled_mlp: bool = _f(
        False,
        "Run each decoder MLP over tiles of mlp_tile_tokens tokens, recomputed tile by tile in backward, so no "
        "(tokens × intermediate) tensor of the whole sequence exists (lowmem_ft.train.savers.tiles); costs one more MLP "
        "forward per step.",
        planner="tiled_mlp",
    )
    mlp_tile_tokens: int = _f(
        0,
        "Tokens per tile of tiled_mlp, tiled_norms and recompute_lora; 0 = automatic (hidden_size tokens; under --vram "
        "the planner tries tiles of 1,024 and 256 tokens when the larger ones do not fit).",
        ge=0,
        planner="mlp_tile_tokens",
    )
    tiled_norms: bool = _f(
        False,
        "Run each hidden-size RMSNorm over token tiles, recomputed in backward, so its fp32 copy of the input and "
        "its fp32 backward temporaries exist for one tile at a time (lowmem_ft.train.savers.tiles.tile_norms).",
        planner="tiled_norms",
    )
    recompute_lora: bool = _f(
        False,
        "Recompute each LoRA branch (input cast, dropout, lora_A) in token tiles in backward instead of keeping "
        "peft's fp32 copies of every adapted linear's input (lowmem_ft.train.savers.lora_recompute); costs the LoRA "
        "branches' forward once more.",
        planner="recompute_lora",
    )
    embeddings_on_host: bool = _f(
        False,
        "Keep the frozen input embedding table in host memory: the lookup runs on the CPU and only the gathered rows "
        "move to the device (untied models with LoRA only; lowmem_ft.train.savers.host_embeddings).",
        planner="embeddings_on_host",
    )


@dataclass
class DataSection:
    path: str = _f(
        "",
        "Training data: a JSONL / JSON / Parquet / CSV / TSV file, a directory of them, a `save_to_disk` directory, "
        "or a Hugging Face Hub data set id (org/name).",
        flag=Flag("--data"),
    )
    split: str = _f(
        "train", "Split to train on: of a Hub data set, a saved DatasetDict, or a directory with train/test files."
    )
    subset: str = _f("", "Configuration name of a Hub data set that has several (load_dataset's `name`).")
    columns: dict[str, str] = _f(
        {},
        "Our field names mapped to the data set's own columns, e.g. {prompt: question, completion: answer}; "
        "applied before the format is detected.",
    )
    mix: list[dict[str, Any]] = _f(
        [],
        "Train on several data sets instead of `path`: a list of {path, weight, split, subset, columns, format} "
        "(unset keys take this section's values); weights are shares of the mixed samples, drawn with training.seed.",
    )
    mix_strategy: MixStrategy = _f(
        "undersample",
        "undersample: no sample repeats, the mix is as large as the scarcest source (for its weight) allows; "
        "oversample: every sample is used, sources short of their share repeat samples.",
    )
    streaming: bool = _f(
        False,
        "Read the data as a stream (data sets larger than memory): not cached, the length profile comes from the "
        "first samples, and training.max_steps must be set.",
    )
    format: DataFormat = _f(
        "auto",
        "Record shape; auto detects text, prompt/completion (strings, or lists of turns: chat_prompt_completion), "
        "messages, sharegpt, alpaca.",
        flag=Flag("--format", "force the data format; default: detect it", hidden_choices=("auto",)),
    )
    train_on_prompt: bool = _f(
        False, "Also compute the loss on prompt / user tokens (default: completion / assistant only)."
    )
    chat_template: str = _f(
        "",
        "Chat template for chat data: empty = the tokenizer's (ChatML when it has none); a name (chatml, mistral, "
        "llama2, granite, or TRL's copies: llama3, qwen2_5, qwen3, gemma, gemma3, phi3, ...) or a .jinja file. "
        "Saved with the adapter, so generate uses it too.",
    )
    truncate: Truncate = _f("keep_start", "What happens to samples longer than memory.max_seq_len.")
    overlap: int = _f(128, "Tokens shared by consecutive chunks when truncate is chunk.", ge=0)
    packing: bool = _f(False, "Pack several samples into one max_seq_len sequence (no attention across samples).")
    skip_bad_lines: bool = _f(
        False,
        "Skip malformed lines (and report them) instead of stopping.",
        flag=Flag("--skip-bad-lines", "skip malformed data lines and report them", switch=True),
    )
    eval_path: str = _f(
        "",
        "Evaluation data, any source `path` takes (default: none, eval_split, or eval_fraction of the training data).",
        flag=Flag("--eval-data", "evaluation data, any source --data takes"),
    )
    eval_split: str = _f(
        "", "Split of the evaluation data: of eval_path, or of `path` when eval_path is empty (e.g. test, validation)."
    )
    eval_fraction: float = _f(
        0.0,
        "Fraction of the training data held out for evaluation (instead of eval_path or eval_split).",
        ge=0.0,
        lt=1.0,
    )


@dataclass
class TrainingSection:
    method: Method = _f(
        "sft",
        "What is learned: sft (supervised), or preference training: dpo (TRL's DPOTrainer), orpo, simpo (TRL's "
        "experimental ORPO / CPO trainers) on prompt/chosen/rejected pairs; kto (TRL's KTOTrainer) on unpaired "
        "prompt/completion/label samples. The preference section holds their settings. grpo: online RL on TRL's "
        "GRPOTrainer (completions generated per prompt, scored by reward functions); the grpo section holds its "
        "settings.",
        flag=Flag("--method", "what is learned: %(choices)s (default sft)", metavar="METHOD"),
    )
    epochs: float = _f(
        1.0,
        "Passes over the data, fractions allowed (ignored when max_steps > 0).",
        gt=0.0,
        flag=Flag("--epochs", "passes over the data", metavar="N"),
    )
    max_steps: int = _f(
        -1,
        "Optimizer steps to run; -1 runs `epochs` passes.",
        flag=Flag("--max-steps", "optimizer steps to run (-1: run --epochs passes)", metavar="N"),
    )
    seed: int = _f(42, "Seed for data order and adapter initialization.", ge=0)
    logging_steps: int = _f(10, "Log loss every N optimizer steps.", ge=1)
    save_steps: int = _f(200, "Save a resumable checkpoint every N optimizer steps.", ge=1)
    save_total_limit: int = _f(2, "Checkpoints kept on disk (the newest; 0 keeps every one).", ge=0)
    rank_timeout_s: int = _f(
        1800,
        "Under --gpus: seconds a process waits for the others at a training collective before the launch fails (a "
        "rank hung or gone); transformers' ddp_timeout, whose default this is. Keep it above the longest checkpoint "
        "save. While the ranks build (imports, data, model) they wait at least 1800 s for the slowest.",
        ge=1,
    )
    eval_steps: int = _f(200, "Evaluate every N optimizer steps when there is eval data.", ge=1)
    output_dir: str = _f(
        "runs",
        "Parent directory of run directories.",
        flag=Flag("--output-dir", "parent directory of run directories", metavar="DIR"),
    )


@dataclass
class LoggingSection:
    report_to: list[Tracker] = _f(
        ["wandb"],
        "Trackers that get the metrics, the resolved recipe and the plan (transformers' report_to names): wandb, "
        "tensorboard (into the run directory's tensorboard/), trackio, or none.",
        flag=Flag(
            "--report-to",
            f"trackers for metrics, recipe and plan: {', '.join(typing.get_args(Tracker))}",
            metavar="TRACKER",
        ),
    )
    wandb_project: str = _f("lowmem-ft", "Weights & Biases (and trackio) project.")
    wandb_mode: WandbMode = _f(
        "auto",
        "online, offline, disabled, or auto (online when logged in, offline otherwise); disabled drops wandb.",
        flag=Flag("--no-wandb", "do not log to Weights & Biases", switch="disabled"),
    )


@dataclass
class PreferenceSection:
    """Settings of the preference methods (training.method dpo, orpo, simpo, kto); ignored by sft."""

    loss_type: DpoLoss = _f("sigmoid", "DPO's loss, as TRL names its variants (sigmoid, ipo, robust, hinge, ...).")
    beta: float = _f(
        0.1,
        "DPO's β (deviation from the reference; IPO's τ), ORPO's odds-ratio weight λ, SimPO's reward scale.",
        gt=0.0,
    )
    label_smoothing: float = _f(0.0, "Robust DPO's flip probability (loss_type robust), EXO's ε.", ge=0.0, lt=0.5)
    simpo_gamma: float = _f(0.5, "SimPO's target reward margin γ (TRL's CPOConfig simpo_gamma).", ge=0.0)
    prompt_truncation: PromptTruncation = _f(
        "keep_end",
        "A pair longer than memory.max_seq_len, before batching: keep_end / keep_start cut the prompt to "
        "max_prompt_len (its end or its start), then the answers at their end; drop leaves the pair out (counted).",
    )
    max_prompt_len: int = _f(0, "The prompt's share of a pair that does not fit; 0: half of max_seq_len.", ge=0)
    reference: ReferenceModel = _f(
        "auto",
        "DPO's reference: auto (LoRA: the base model with the adapter disabled; full fine-tuning: log-probs "
        "precomputed in one pass before training), copy (a frozen copy of the model), precomputed.",
    )


@dataclass
class GrpoSection:
    """Settings of GRPO (training.method grpo, TRL's GRPOTrainer on its transformers generation path); ignored by
    the other methods. memory.micro_batch_size counts completions (b) for GRPO."""

    num_generations: int = _f(
        4,
        "Completions generated per prompt (G); the advantages compare a prompt's G completions. With --vram the "
        "planner may lower it when a round does not fit, unless you set it.",
        ge=2,
        lt=INT_LIMIT,
    )
    max_completion_length: int = _f(
        256,
        "Longest completion in tokens (C), TRL's max_completion_length. With --vram the planner may lower it when a "
        "round does not fit, unless you set it.",
        ge=1,
        lt=INT_LIMIT,
    )
    max_prompt_length: int = _f(
        256,
        "Longest prompt in tokens (P) after the chat template; longer prompts are cut or left out by "
        "prompt_truncation and counted (TRL 1.16 never truncates a prompt, and generation's memory grows with the "
        "longest); 0: no limit (the data's longest).",
        ge=0,
        lt=INT_LIMIT,
    )
    prompt_truncation: PromptTruncation = _f(
        "keep_end",
        "A prompt longer than max_prompt_length: keep_end / keep_start cut a text prompt to its last / first tokens "
        "(a conversation loses its oldest turns), drop leaves the row out.",
    )
    steps_per_generation: int = _f(
        0,
        "Micro-steps one generation round covers: a round generates micro_batch_size × steps_per_generation "
        "completions in one call. 0: gradient_accumulation (TRL's default; with --vram the planner chooses).",
        ge=0,
        lt=INT_LIMIT,
    )
    beta: float = _f(
        0.0,
        "KL coefficient; above 0 a reference pass is added (LoRA: the adapter switched off; full fine-tuning: a "
        "second copy of the weights). TRL's default is 0.",
        ge=0.0,
    )
    loss_type: GrpoLoss = _f("dapo", "TRL's GRPO loss aggregation (dapo, grpo, dr_grpo, bnpo, cispo, sapo, ...).")
    epsilon: float = _f(0.2, "Clipping range of the probability ratio (TRL's epsilon).", gt=0.0)
    temperature: float = _f(1.0, "Sampling temperature of the generated completions.", gt=0.0)
    top_p: float = _f(
        1.0, "Nucleus sampling: the smallest set of tokens whose probability reaches top_p.", gt=0.0, le=1.0
    )
    rewards: list[str] = _f(
        [],
        "Built-in reward functions as NAME[:WEIGHT]: exact_match, numeric_match (against answer_column), format "
        "(format_regex), length_penalty. Your own function from a file is named on the command line only "
        "(--reward-fn path.py:name[:weight]), never in a recipe.",
    )
    answer_column: str = _f("answer", "The data column exact_match and numeric_match compare with.")
    format_regex: str = _f(r"####\s*\S+", "The pattern the format reward searches each completion for.")
    use_vllm: bool = _f(
        False,
        "Generate with vLLM: refused — TRL 1.16 accepts vLLM 0.22-0.31, which require transformers < 5.18, and "
        "lowmem-ft pins transformers 5.24; generation runs on transformers.",
    )


@dataclass
class VisionSection:
    """Images in the data (a vision-language checkpoint, lowmem_ft.vision); ignored by text-only models."""

    max_pixels: int = _f(
        0,
        "The most pixels one image keeps (the processor's max_pixels: an image is resized to fit, aspect kept, and "
        "becomes up to max_pixels / 784 tokens on Qwen2.5-VL; on Idefics3 / SmolVLM the longest edge is the largest "
        "multiple of the tile within sqrt(max_pixels); LLaVA-1.5's fixed crop and LLaVA-OneVision's pinpoint grids ignore it). 0: the planner picks it "
        "from the data's images and the VRAM target, capped by the checkpoint's preprocessor_config.json.",
        ge=0,
    )
    train: VisionTrain = _f(
        "frozen",
        "How the vision tower trains: frozen (no gradient: it runs once per image and keeps nothing for backward), "
        "lora (LoRA adapters on its linear layers, at adapter.r) or full (every tower parameter trainable). The "
        "plan prices each: the tower's saved activations, and its adapter or gradients and optimizer states.",
        planner="vision_train",
    )


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    adapter: AdapterSection = field(default_factory=AdapterSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    memory: MemorySection = field(default_factory=MemorySection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)
    vision: VisionSection = field(default_factory=VisionSection)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Recipe)}  # type: ignore[misc]


@dataclass(frozen=True)
class Key:
    """One recipe key as declared: `section.name`, its type, default and the declaration's metadata."""

    section: str
    name: str
    type: Any
    field: Field

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if callable(f.default_factory) else f.default

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def bounds(self) -> dict[str, float]:
        """The declared range: `ge`, `gt`, `le`, `lt` as given (see `_f`)."""
        return {b: self.field.metadata[b] for b in ("ge", "gt", "le", "lt") if self.field.metadata.get(b) is not None}

    @property
    def flag(self) -> Flag | None:
        return self.field.metadata.get("flag")

    @property
    def flag_help(self) -> str:
        """The flag's line in `--help`: the flag's own words, else the key's help as a line (its first letter in
        lower case, no final period)."""
        flag = self.flag
        if flag is not None and flag.help:
            return flag.help
        text = self.help.rstrip(".")
        return text[:1].lower() + text[1:]

    @property
    def planned(self) -> Planned | None:
        return self.field.metadata.get("planner")

    def of(self, recipe: Recipe) -> Any:
        """This key's value in `recipe`."""
        return getattr(getattr(recipe, self.section), self.name)


def _keys() -> dict[str, Key]:
    out = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            out[f"{section}.{f.name}"] = Key(section, f.name, hints[f.name], f)
    return out


KEYS: dict[str, Key] = _keys()
"""Every recipe key, `section.name` → its declaration, in schema order."""
