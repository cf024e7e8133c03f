"""Peak training memory as named components: pure arithmetic over an `Architecture` (no torch import).

The one idea: the peak of a training step is the static state (weights, trainable parameters, their gradients and
optimizer states) plus the largest of two transient phases — forward/backward (saved activations, the loss's
working set, a dequantization buffer) and the optimizer step (its temporaries) — plus device overheads and the
safety margin. Each term is a `Component` that says where its constant comes from, so the same numbers serve
`plan`, the planner, the monitor's "predicted" line and the report.

Conventions: "tokens" = micro_batch × max_seq_len; c = bytes of the compute dtype; every constant cites the library
code it was read from (installed versions: transformers 5.24, peft 0.21, bitsandbytes 0.50, trl 1.16, torch 2.13)
or the measurement it comes from (`scripts/validate_estimator.py`, CPU, exact live tensor bytes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from lowmem_ft.memory.arch import Architecture, Linear

GB = 1e9  # lowmem-ft speaks decimal GB, as `--vram 24` does
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# bitsandbytes functional.quantize_4bit: blocksize 64, one fp32 absmax per block → 4 + 32/64 = 4.5 bits/param.
# With double quant (compress_statistics) the absmax are quantized to 8 bits in blocks of 256 with an fp32 absmax
# each → 4 + 8/64 + 32/(64·256) ≈ 4.127 bits/param.
NF4_BITS = 4.5
NF4_DQ_BITS = 4 + 8 / 64 + 32 / (64 * 256)
# Beyond the per-parameter bits, each quantized linear's QuantState holds the NF4 code (16 fp32) and, with double
# quant, the absmax offset (one fp32) and the 8-bit code of the absmax quantization (256 fp32): 64 + 4 + 1024 B (read
# from a quantized Linear4bit's quant_state; found by the exact CPU measurement of real runs, lowmem_ft.train.exact,
# as 1092 B of static memory per linear the estimate lacked).
NF4_STATE_BYTES = 16 * 4
NF4_DQ_STATE_BYTES = 16 * 4 + 4 + 256 * 4
# bitsandbytes Linear8bitLt (LLM.int8): int8 weight + one fp32 scale (SCB) per output row.
INT8_ROW_SCALE_BYTES = 4
# bitsandbytes optim/optimizer.py Optimizer2State.init_state: 8-bit states are two uint8 tensors plus two fp32
# absmax per block of 256; tensors with fewer than `min_8bit_size` = 4096 elements keep fp32 states; paged buffers
# (get_state_buffer) are used only for tensors of ≥ 1e5 elements and only on CUDA.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_PAGED_MIN = 100_000
# TRL 1.16 kernels/chunked_logprob.py: the fused LM head SFTTrainer installs (`add_fused_lm_head`) projects the
# hidden states in tiles of TOKEN_CHUNK_SIZE tokens × `_CHUNKED_LOGPROB_CHUNK_SIZE` vocabulary (trainer/utils.py).
# ChunkedLogProbFunction.forward/backward each allocate `mm_buf = empty((min(N, 4096), chunk_size))` in the compute
# dtype: its width is the full 32,768 even when the vocabulary is smaller (measured: 2.05 fp32 tiles of a
# 512 × 8000 tile = 512 × 32768 × 2 B).
TRL_TOKEN_CHUNK = 4096
TRL_VOCAB_CHUNK = 32768
# Without Triton (the CPU) each tile is folded with torch ops, `_forward_tile` / `_backward_tile`, that hold fp32
# copies of the tile (n × min(V, 32768) × 4 B) at once. Counted op by op with a PeakMemory trace of
# ChunkedLogProbFunction alone (N 512, V 8000, H 64, bf16; the counts follow from the code): forward peak at
# `e = torch.exp(z - new_m)`: z, the z − max temporary, e (3 fp32) + the bool `before_target` mask of is_top1
# (1 B = 0.25 fp32) → 3.25; backward peak at
# `is_target.float() - p`: y, z, log_p, p, grad, is_target.float(), the difference (7 fp32) + the bool is_target
# → 7.25. The backward's `_addmm_fp32` then upcasts on the CPU (`acc.addmm_(a.float(), b.float())`): an fp32 tile
# and an fp32 copy of the vocabulary chunk of the weight (min(V, 32768) × H × 4 B), plus the fp32 hidden chunk
# when the head is trained. On CUDA (Triton) the folds run in registers and `torch.addmm(..., out_dtype=float32)`
# needs no upcast: only mm_buf and the fp32 gradient accumulators remain (read from the code, not measured here).
CPU_TILE_FP32_FWD = 3.25
CPU_TILE_FP32_BWD = 7.25
# memory.chunked_loss (lowmem_ft/train/losses.py ChunkedLinearCrossEntropy): a chunk of k tokens; by default
# (memory.loss_chunk_tokens 0) 64 MiB of fp32 logits, i.e. 64 MiB / (4·V) tokens (110 at a 152k vocabulary).
# Working sets per logit of the chunk, measured with PeakMemory on the function alone (n 2000, h 64, V 8000, k 500;
# bf16 and fp32, with and without a softcap): forward 8 B — the fp32 logits and the softmax made from them in place
# (12 with a softcap in fp32: the tanh's temporaries); backward 4 B — the fp32 logits turned into their gradient in
# place — plus the c-byte matmul output / gradient cast when c < 4 (6.0 and 4.0 measured); with a softcap the
# logits stay for its derivative: 16 B. On top of the backward's chunk, the c-byte `grad_hidden` of all n tokens
# and three fp32 per-token gradients (log-probs' gradient, masked_scatter's backward and its zeros: 12 B per token,
# measured in a tiny-model run at 4,096 tokens). The loss input `hidden[mask]` is a c-byte copy kept from forward
# to backward, beside its int64 targets, fp32 log-probs and two bool masks (same run).
# The head projects the labelled positions only (`token_log_probs`: `hidden[mask]`, mask = shifted labels ≠ −100),
# so the chunks, the `hidden[mask]` copy, its int64 targets and fp32 log_z (CHUNKED_LABEL_BYTES) and the backward's
# per-token gradients scale with the labelled positions (`Setup.loss_tokens`); the bool mask and the scattered bool
# top-1 hits are per position (CHUNKED_POSITION_BYTES). Measured with PeakMemory on `token_log_probs` alone (S 4,096,
# h 64, V 8,000, bf16, chunks of 256; 4,095 / 2,048 / 1,024 / 256 labelled positions): kept after forward
# 140 B per labelled position (c·h + 12) + 10.0 B per position (the 8-byte padded targets of TOKEN_BOOKKEEPING_BYTES
# and these 2); backward beyond its chunk 137 B per labelled position (c·h + 9 ≤ c·h + 12) and nothing per position
# (tests/memory/test_estimate_loss.py). TRL's fused head (chunked_loss off) compacts to the labelled positions too,
# but on Triton devices only (trl/trainer/utils.py add_fused_lm_head: `compact = _use_triton(...)`); on the CPU, where
# runs are measured exactly, it scores every position, so its terms (TRL_*) count every position.
CHUNK_FP32_BYTES = 64 * 2**20
CHUNK_FWD_BYTES_PER_LOGIT, CHUNK_FWD_BYTES_PER_LOGIT_SOFTCAP_FP32 = 8, 12
CHUNK_BWD_BYTES_PER_LOGIT, CHUNK_BWD_BYTES_PER_LOGIT_SOFTCAP = 4, 16
CHUNK_BWD_BYTES_PER_TOKEN = 3 * 4
CHUNKED_LABEL_BYTES, CHUNKED_POSITION_BYTES = 8 + 4, 2
# transformers loss/loss_utils.py ForCausalLMLoss: logits (c bytes) are upcast with .float() (4 B) and
# cross_entropy saves its fp32 log_softmax (4 B); backward makes an fp32 gradient (4 B) before the c-byte one.
HF_LOSS_BYTES_PER_LOGIT = 4 + 4 + 4  # plus the c-byte logits themselves
# ATen native/Dropout.cpp `is_fused_kernel_acceptable`: CUDA/XPU inputs take `native_dropout`, which saves a bool
# mask (1 B); other devices (the CPU) take the composite `_dropout_impl` (empty_like(input).bernoulli_() * input),
# which saves a noise tensor in the input's dtype — fp32 for peft's LoRA input. Measured on the CPU: a LoRA layer
# keeps 3 B/element more per adapted linear input than with a bool mask (PeakMemory, models built with 1 and 2
# layers, difference = one layer; benchmarks/estimator_cpu.md).
DROPOUT_MASK_BYTES = {"cuda": 1, "cpu": 4}
# Per-token tensors alive through forward and backward besides the layers: RoPE cos and sin (c × head_dim each,
# computed once by the model's rotary embedding, saved by every layer's `q * cos`), the loss's int64 shifted targets
# (8 B) and fp32 log_z and entropy the fused head saves (4 B each). Measured remainder 23-35 B/token beyond RoPE
# with one batch's tensors (PeakMemory, the 1-layer model's forward minus one layer).
TOKEN_BOOKKEEPING_BYTES = 8 + 2 * 4
# The batch's tensors, int64 (TRL DataCollatorForLanguageModeling: input_ids, labels and attention_mask, or
# position_ids when padding-free): 3 × 8 B per token. transformers' Trainer fetches a whole accumulation window's
# micro batches before the window's first forward (trainer.py get_batch_samples), each already on the device
# (accelerate DataLoaderShard.__iter__ sends a batch there before yielding it), and they stay referenced through the
# optimizer step; the loader also holds the next batch, on the host, to see the end of the data — device memory on
# the CPU only. Measured on the CPU (PeakMemory, a tiny-model run at 4,096 tokens, accumulation 1, optimizer step):
# six (1, 4096) int64 tensors from the collator's `torch.full`, 196.6 KB.
BATCH_BYTES_PER_TOKEN = 3 * 8
BATCH = "batch tensors (ids, labels, mask)"
# Backward transients measured on the CPU with PeakMemory (the backbone alone with `last_hidden_state.sum()`; Qwen2-
# and Llama-shaped layers, h 512/384, i 1408/1024): without checkpointing the backward's first op, the final RMSNorm
# backward, holds ~5 fp32 hidden-sized gradients (20·h B/token: 10236 and 7676 measured vs 10240 and 7680); with
# checkpointing the recomputed layer's saved activations plus MLP/LoRA gradients in flight ≈ (8·i + 5·h) B/token
# (13676 and 10076 measured vs 13824 and 10112). Same eager ops on CUDA, so assumed to carry over.
NORM_BWD_BYTES_PER_H = 20
RECOMPUTE_BWD_I, RECOMPUTE_BWD_H = 8, 5
# memory.tiled_mlp with checkpointing (devkit/long_context_check.py, PeakMemory; fitted on a Llama-shaped h 128 /
# i 512 model at 1-2k tokens, checked on Qwen2- and Mistral-shaped ones at 1-8k, benchmarks/long_context_cpu.md):
# outside the MLP the recomputed layer's backward holds ~14·h B/token of gradients in flight (8·i + 5·h untiled:
# the MLP's share is gone); the MLP's backward runs one tile at a time — the tile's recomputed MLP tensors plus
# TILE_BWD_I·i B per tile token of gradients — beside the tiles' input gradients gathered for the split (c·h per
# token). The larger of the two is the term.
TILED_RECOMPUTE_BWD_H = 14
TILE_BWD_I = 6
# memory.recompute_lora without tiled_mlp: the recomputed MLP's gradients in flight are ~7·i + 5·h B/token (measured
# as above: 3,646 and 3,614 B/token at 1k and 2k tokens for i 512, h 128); 6·i + 5·h is within 3 %, on the safe side.
RECOMPUTE_BWD_I_LORA_RECOMPUTED = 6
# memory.tiled_norms (same yardstick, tiles of 16 and 128 tokens): the RMSNorms' fp32 backward was most of the 14·h
# above; with them tiled the layer's backward holds ~4·h B/token in flight (514 measured for h 128), and one MLP
# tile ~8·i B per tile token beside its recomputed tensors (13.6 KB measured vs 13.4 KB) with no per-token gather in
# the peak; without checkpointing the final norm's fp32 backward (NORM_BWD_BYTES_PER_H) is per tile too.
TILED_NORMS_RECOMPUTE_BWD_H = 4
TILE_BWD_I_TILED_NORMS = 8
# That 4·h was measured with recompute_lora on. With tiled MLP and norms but peft's own LoRA branches, the recomputed
# attention's LoRA backward holds more fp32 in flight: 10.1·h B/token (PeakMemory at 2,048 tokens, tiles of 64, the
# long-context yardstick's Llama, Qwen2 and Mistral shapes: 10.10, 10.06, 10.11; the 4·h under-predicted those peaks
# by 7.6-8.3 %); 10.5 keeps it on the safe side.
TILED_NORMS_BWD_H = 10.5
# The largest transient of one layer's forward (LoRA), beyond what the layers keep for backward and RoPE's cos/sin:
# measured at the layers' own peak (PeakMemory's window peak read by a forward pre-hook on the final norm, so the
# head's tensors, which do not exist yet, are not in it) and attributed op by op (a PeakMemory subclass recording
# each live storage's creating op and shape at the peak); Llama- (h 128, i 512, GQA 4/2), Qwen2- (h 96, i 448,
# GQA 6/2) and Mistral-shaped (h 160, i 384, MHA) models of devkit/long_context_check.py at 2,048 tokens, LoRA r 8,
# every combination of tiled_mlp / tiled_norms / recompute_lora, with and without checkpointing (14 setups per
# shape, 42 in all; the terms below, FWD_TOKEN_STATS_BYTES included, are within 4 B/token of each).
# In peft's LoRA layer (lora/layer.py Linear.forward) the base output comes first (c bytes per output element),
# then the input's fp32 cast (4), the dropout noise (DROPOUT_MASK_BYTES) and dropped copy (4), lora_B's fp32 output
# and its scaled copy (4 + 4 per output element). Under checkpointing nothing of it is kept: the moment of the
# widest-input linear holds the input and its three copies (c + mask + FWD_TRANSIENT_CKPT per input element)
# beside three c-byte hidden-sized tensors (the residual sum after attention, the MLP input and the base output:
# FWD_BESIDE_CKPT). Without checkpointing the noise and dropped copy are kept already, and the peak is the widest-
# input linear's output side: input and cast (c + FWD_TRANSIENT_NO_CKPT) beside base output, lora_B output and
# scaled copy (c + FWD_OUTPUT_FP32 per output element), and four hidden-sized tensors (the model's input embeddings,
# which its forward holds, the layer's input, the residual sum, the MLP input; two with tiled norms, whose saved
# views of their inputs are counted as kept).
FWD_TRANSIENT_CKPT, FWD_TRANSIENT_NO_CKPT, FWD_OUTPUT_FP32 = 8, 4, 8
FWD_BESIDE_CKPT, FWD_BESIDE_NO_CKPT, FWD_BESIDE_NO_CKPT_TILED_NORMS = 3, 4, 2
# With tiled_mlp under checkpointing the peak moves to the attention's output projection: q, k, v and the attention
# output (c each), the layer input's norm output and the projection's base output (c·h each) beside its LoRA copies
# (peft: mask + 8 per input element; recompute_lora: 8 per output element, the fp32 tile outputs and their
# concatenation). Measured as above: 2,816 / 3,840 / 2,048 B/token (Llama / Mistral / Qwen2 shape, peft LoRA) and
# 2,304 / 3,200 / 1,664 (recompute_lora), each +8.
# Two fp32 per-token statistics in flight at every layer moment (the RMSNorm's mean and rsqrt): the +8 B/token above.
FWD_TOKEN_STATS_BYTES = 2 * 4
# Cohere's LayerNorm (modeling_cohere.py / _cohere2.py CohereLayerNorm, q/k norms included) is mean-centred and
# composite in fp32: `(x - mean).pow(2)` keeps its fp32 input and `(x - mean) * rsqrt(...)` a second fp32 x − mean of
# its own, one fp32 copy per element more than an RMSNorm, whose pow and mul share the upcast. Measured with
# autograd's saved-tensor hooks (every saved storage counted once, per module) on a Cohere h 256 / 3-layer model
# with q/k norms, bf16, 256 tokens: input_layernorm keeps 2 × 1,024 + 4 B/token (LoRA; + 1,024 for the normalized
# input under a full fine-tune), q_norm 2 × 1,024 + 16, k_norm 2 × 512 + 8; PeakMemory per layer agrees
# (tests/memory/test_estimate.py, Cohere and Apertus layer bytes), and so do the --blocks grid's peaks, within 0.1 %
# (scripts/validate_estimator.py --blocks, benchmarks/estimator_blocks.md).
CENTRED_NORM_EXTRA_FP32 = 4
# xIELU (transformers activations.py XIELUActivation._xielu_python, the path without the optional `xielu` CUDA
# package): `alpha_p * x * x` keeps x and alpha_p·x, `expm1(min(x, eps))` its output, `torch.where` its bool
# condition, and with trainable alpha_n `(expm1(...) - x) * alpha_n` keeps the difference. Measured as above on an
# Apertus h 256 / i 704 model: 3 × 1,408 + 704 B/token (LoRA: frozen alphas), 4 × 1,408 + 704 (full), against the
# c·i a plain activation keeps: (2·c + 1)·i more, and c·i more again when the alphas train (the same test and grid).
XIELU_KEPT_C, XIELU_KEPT_C_TRAINED, XIELU_KEPT_BOOL = 2, 1, 1
# Device overheads (CUDA only). Assumed, not measured in this session (no GPU): the GPU run of the harness
# measures NVML device use minus torch's reserved bytes.
CUDA_CONTEXT_BYTES = 0.5 * GB  # torch 2.x + CUDA 12 context with lazy module loading (typical nvidia-smi reading)
# torch aten/src/ATen/cuda/CublasHandlePool.cpp getChosenWorkspaceSize: 32 MiB per handle on Hopper (4 MiB before),
# plus the cuBLASLt workspace of the same size.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20
# Caching allocator: block rounding (512 B / 2 MiB segments) and fragmentation of the transient tensors, as a
# fraction of the transient peak. Assumed from typical reserved/allocated ratios of 1.05–1.15 in training.
ALLOCATOR_FRACTION = 0.10

LossImpl = Literal["trl_fused", "hf_full", "chunked"]
Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class Setup:
    """The knobs that change memory, independent of the recipe dataclasses (`lowmem_ft.planning.setup_from_recipe`)."""

    quantization: Literal["nf4", "int8", "none"] = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    adapter: Literal["lora", "full"] = "lora"
    lora_r: int = 16
    lora_dropout: float = 0.05
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    optimizer: str = "paged_adamw_8bit"
    gradient_checkpointing: bool = True
    micro_batch_size: int = 1
    max_seq_len: int = 1024
    gradient_accumulation: int = 1  # micro batches per optimizer step (their batch tensors are held together)
    activation_offloading: bool = False
    loss_impl: LossImpl = "trl_fused"
    loss_chunk_tokens: int | None = None  # memory.chunked_loss: tokens per chunk (None: as losses.py sizes them)
    # labelled positions of a micro batch (labels ≠ -100 after the shift), what the chunked loss projects
    # (`loss_positions`); None: every position, the upper bound a plan keeps (it does not know the batches' labels)
    loss_tokens: int | None = None
    tiled_mlp: bool = False  # memory.tiled_mlp (lowmem_ft/train/tiled_mlp.py)
    mlp_tile_tokens: int = 0  # tokens per MLP tile; 0: hidden_size (tiled_mlp.mlp_tile_tokens)
    embeddings_on_host: bool = False  # memory.embeddings_on_host (lowmem_ft/train/host_embeddings.py)
    recompute_lora: bool = False  # memory.recompute_lora (lowmem_ft/train/lora_recompute.py)
    tiled_norms: bool = False  # memory.tiled_norms (lowmem_ft/train/tiled_mlp.py tile_norms)
    device: Device = "cuda"
    safety_margin_gb: float = 1.0

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.max_seq_len


@dataclass
class Component:
    name: str
    bytes: float
    phase: Literal["static", "forward/backward", "optimizer step", "overhead", "host"]
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
    phases: dict[str, float] = field(default_factory=dict)  # live tensor bytes at each phase's peak (no overheads)

    @property
    def peak_bytes(self) -> float:
        return self.model_peak_bytes + self.overhead_bytes

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB

    def by_name(self) -> dict[str, float]:
        return {c.name: c.bytes for c in self.components}

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted_peak_gb": round(self.peak_gb, 3),
            "model_peak_gb": round(self.model_peak_bytes / GB, 3),
            "overhead_gb": round(self.overhead_bytes / GB, 3),
            "peak_phase": self.peak_phase,
            "components": [
                {"name": c.name, "gb": round(c.gb, 4), "phase": c.phase, "source": c.source} for c in self.components
            ],
            "setup": asdict(self.setup),
        }


# -- static state -----------------------------------------------------------------------------------------------
def _trainable_tensors(arch: Architecture, s: Setup) -> list[tuple[int, int]]:
    """(numel, bytes per element) of each trainable tensor."""
    if s.adapter == "full":
        c = DTYPE_BYTES[s.compute_dtype]
        out: list[tuple[int, int]] = []
        for lin in arch.linears:
            out += [(lin.in_features * lin.out_features, c)] * arch.num_layers
            if lin.bias:
                out += [(lin.out_features, c)] * arch.num_layers
        norm_size = arch.hidden_size * (2 if arch.norm == "layer" else 1)
        out += [(norm_size, c)] * (arch.num_layers * arch.norms_per_layer + 1)
        if arch.qk_norm:  # Cohere's are per head: (heads, head_dim) and (kv heads, head_dim)
            q, k = (arch.num_heads, arch.num_kv_heads) if arch.qk_norm_per_head else (1, 1)
            out += [(q * arch.head_dim, c), (k * arch.head_dim, c)] * arch.num_layers
        out += [(1, c)] * (arch.block_extra_params * arch.num_layers)  # Apertus's xIELU scalars
        out.append((arch.embedding_params, c))
        if arch.lm_head_params:
            out.append((arch.lm_head_params, c))
        if arch.moe:  # the expert stacks and the router are trained too (planning refuses this: not measured)
            e, i, h = arch.moe.experts, arch.moe.intermediate_size, arch.hidden_size
            out += [(e * 2 * i * h, c), (e * h * i, c), (e * h, c)] * arch.num_layers
            if arch.moe.extra_norm_params:  # OLMoE's q/k norms span all heads, not head_dim
                out += [(arch.moe.extra_norm_params, c)] * arch.num_layers
        return out
    # peft LoRA: A is r × in, B is out × r, fp32 (autocast_adapter_dtype=True in lowmem_ft.train.model)
    out = []
    for lin in lora_linears(arch, s):
        out += [(s.lora_r * lin.in_features, 4), (lin.out_features * s.lora_r, 4)] * arch.num_layers
    return out


def lora_linears(arch: Architecture, s: Setup) -> list[Linear]:
    targets = arch.lora_targets(list(s.lora_targets))
    return targets


def weight_bytes(arch: Architecture, s: Setup) -> tuple[float, float, str]:
    """(quantized linears, 16-bit rest, description) of the base weights."""
    c = DTYPE_BYTES[s.compute_dtype]
    # bitsandbytes replaces every nn.Linear but the LM head: a loaded vision tower's too (`Architecture.tower_linears`;
    # checked on a tiny Gemma3ForConditionalGeneration: its SigLIP q/k/v/out_proj and fc1/fc2 load as Linear4bit)
    tower = arch.tower_linears
    n_lin = arch.num_layers * sum(lin.in_features * lin.out_features for lin in arch.linears)
    n_lin += sum(lin.in_features * lin.out_features for lin in tower)
    n_rest = arch.total_params - n_lin  # embeddings, lm_head (once if tied), norms, biases
    if s.quantization == "nf4":
        bits = NF4_DQ_BITS if s.double_quant else NF4_BITS
        modules = arch.num_layers * len(arch.linears) + len(tower)
        state = modules * (NF4_DQ_STATE_BYTES if s.double_quant else NF4_STATE_BYTES)
        return n_lin * bits / 8 + state, n_rest * c, f"NF4 {bits:.3f} bit/param (bitsandbytes quantize_4bit, block 64)"
    if s.quantization == "int8":
        rows = arch.num_layers * sum(lin.out_features for lin in arch.linears) + sum(lin.out_features for lin in tower)
        return n_lin + rows * INT8_ROW_SCALE_BYTES, n_rest * c, "int8 + fp32 row scales (bnb Linear8bitLt)"
    return n_lin * c, n_rest * c, f"{s.compute_dtype} ({c} B/param)"


def trainer_fp32_states(arch: Architecture, s: Setup) -> int:
    """Elements of the trainable tensor whose states a bitsandbytes 8-bit optimizer keeps in 32 bits: transformers'
    `Trainer.create_optimizer` registers every `nn.Embedding` weight with bitsandbytes' `GlobalOptimManager` as
    `optim_bits: 32` (trainer.py). Only a full fine-tune trains the embeddings. Found by the exact CPU measurement of
    real runs (`lowmem_ft.train.exact`): the estimator harness built its optimizer without the override."""
    if s.adapter != "full" or "8bit" not in s.optimizer:
        return 0
    return arch.embedding_params


def _bnb_tensors(tensors: list[tuple[int, int]], optimizer: str, fp32_numel: int) -> list[tuple[int, int, bool, int]]:
    """(numel, bytes per element, 8-bit states?, count) of bitsandbytes' trainable tensors, one of `fp32_numel`
    elements kept in 32 bits (`trainer_fp32_states`); optimizer/optimizer.py `init_state`: 8-bit only from
    `min_8bit_size` elements."""
    out = []
    for (numel, elem), count in Counter(tensors).items():  # a model repeats a few shapes many times
        eight_bit = "8bit" in optimizer and numel >= BNB_MIN_8BIT_SIZE
        if eight_bit and numel == fp32_numel:
            out.append((numel, elem, False, 1))
            count -= 1
        if count:
            out.append((numel, elem, eight_bit, count))
    return out


def optimizer_state_bytes(
    tensors: list[tuple[int, int]], optimizer: str, device: Device, fp32_numel: int = 0
) -> tuple[float, float]:
    """(on device, paged = may leave the device) bytes of optimizer states for these trainable tensors;
    `fp32_numel`: the tensor whose bitsandbytes states stay 32-bit (`trainer_fp32_states`)."""
    on_device = paged = 0.0
    if optimizer in ("adamw_torch", "adafactor"):
        for (numel, elem), count in Counter(tensors).items():
            if optimizer == "adamw_torch":  # torch AdamW: exp_avg, exp_avg_sq zeros_like(param) → param dtype
                on_device += count * 2 * numel * elem
            else:  # factored row+col (approx. square), fp32
                on_device += count * (4 * numel**0.5 * 2 if numel > 1 else 4)
        return on_device, paged
    for numel, _, eight_bit, count in _bnb_tensors(tensors, optimizer, fp32_numel):
        blocks = -(-numel // BNB_BLOCK)
        size = count * (2 * numel + 2 * 4 * blocks if eight_bit else 2 * 4 * numel)
        if optimizer.startswith("paged") and device == "cuda" and numel >= BNB_PAGED_MIN:
            paged += size
        else:
            on_device += size
    return on_device, paged


def optimizer_step_temp(
    tensors: list[tuple[int, int]], optimizer: str, device: Device, fp32_numel: int = 0
) -> tuple[float, str]:
    """Temporaries the optimizer step allocates (measured on the CPU; read from torch/optim/adamw.py on CUDA)."""
    if not tensors:
        return 0.0, ""
    largest = max(n * e for n, e in tensors)
    if optimizer == "adamw_torch":
        if device == "cuda":  # _multi_tensor_adamw: exp_avg_sq_sqrt = torch._foreach_sqrt(...) → one copy of all
            return sum(n * e for n, e in tensors), "torch AdamW foreach: one param-sized sqrt buffer"
        return 2 * largest, "torch AdamW single-tensor (CPU): sqrt and divide temporaries of the largest tensor"
    if optimizer == "adafactor":
        return 2 * largest, "Adafactor update temporaries of the largest tensor"
    # bitsandbytes: CUDA kernels update in place; the CPU fallback dequantizes a tensor's states to fp32.
    if device == "cuda":
        return 0.0, "bitsandbytes fused kernel, in place"
    # backends/cpu/ops.py, one tensor at a time. _optimizer_update_8bit_blockwise_cpu: fp32 state1, state2, grad
    # (g.float()), p.float(), and sqrt(state2) / correction2 → denom: 6 fp32 copies of the tensor at once;
    # _optimizer_update_32bit_cpu: grad, p.float(), the sqrt + eps denominator and the update: 4. An fp32 parameter
    # needs no p.float() copy: one fewer. Measured with PeakMemory seeing inside the kernels (they are Python,
    # lowmem_ft.train.measure.python_cpu_kernels): 6 / 5 (8-bit, bf16 / fp32 parameter), 4 / 3 (32-bit).
    copies = max(
        numel * ((6 if eight_bit else 4) - (elem == 4))
        for numel, elem, eight_bit, _ in _bnb_tensors(tensors, optimizer, fp32_numel)
    )
    return 4 * copies, "bitsandbytes CPU kernel: 6 (8-bit states) or 4 (32-bit) fp32 copies of a tensor (measured)"


# -- activations ------------------------------------------------------------------------------------------------
ATTENTION_INPUT_LINEARS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn"}  # fed by the input RMSNorm
MLP_LINEARS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2"}  # inside `layers.N.mlp`


def is_mlp_linear(arch: Architecture, lin: Linear) -> bool:
    """A linear of the decoder MLP (what `memory.tiled_mlp` tiles); Qwen v1's MLP `c_proj` is told from the
    attention's by its input width (intermediate vs hidden)."""
    if lin.name == "c_proj":
        return arch.model_type == "qwen" and lin.in_features == arch.intermediate_size
    return lin.name in MLP_LINEARS


def _lora_input_bytes(arch: Architecture, s: Setup, mlp: bool) -> float:
    """Per token, what peft's LoRA layers keep for the attention (`mlp` False) or MLP (True) linears: x.to(fp32) →
    dropout keeps its mask (DROPOUT_MASK_BYTES), lora_A keeps the fp32 dropped input (4 B), lora_B keeps lora_A's
    output (4 B × r). Each adapted linear does this on its own."""
    drop = DROPOUT_MASK_BYTES[s.device] if s.lora_dropout > 0 else 0
    lins = [lin for lin in lora_linears(arch, s) if is_mlp_linear(arch, lin) == mlp]
    if s.recompute_lora and not (mlp and s.tiled_mlp):
        return recomputed_lora_input_bytes(arch, s, lins)
    return sum((4 + drop) * lin.in_features + 4 * s.lora_r for lin in lins)


def recomputed_lora_input_bytes(arch: Architecture, s: Setup, lins: list[Linear]) -> float:
    """Per token, what `recompute_lora` keeps for these adapted linears: each branch checkpoint keeps only its input,
    a c-byte tensor — one for the linears fed by the same norm (q/k/v, gate/up: nothing else keeps a norm's output,
    a frozen base linear keeps no input), one for down_proj (the act × up product), none for the attention's output
    projection: its input is the attention output the attention keeps already (SDPA / flash kernels return it in
    (batch, seq, heads, head_dim) memory order, so transformers' `transpose(1, 2).contiguous()` is that storage).
    Measured per layer with PeakMemory (1- vs 2-layer models): 6,424 and 2,328 (with tiled_mlp) B/token for the
    Llama-shaped probe of tests/memory/test_estimate.py."""
    c = DTYPE_BYTES[s.compute_dtype]
    shared = {"attn": ATTENTION_INPUT_LINEARS, "mlp": {"gate_proj", "up_proj", "gate_up_proj", "w1", "w2"}}
    inputs: dict[str, int] = {}
    for lin in lins:
        if lin.name == "o_proj" or (lin.name == "c_proj" and not is_mlp_linear(arch, lin)):
            continue
        group = next((g for g, names in shared.items() if lin.name in names), lin.name)
        inputs[group] = lin.in_features
    return c * sum(inputs.values())


def mlp_activation_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what one untiled decoder MLP keeps for backward: act(gate) keeps gate (c·i), the product keeps
    act(gate) and up (2·c·i); plus the LoRA inputs of its adapted linears (frozen linears keep nothing)."""
    c = DTYPE_BYTES[s.compute_dtype]
    i = arch.intermediate_size
    acts = (3 * c * i if arch.mlp == "gated" else c * i) + xielu_extra_bytes(arch, s)
    return acts + (0 if s.adapter == "full" else _lora_input_bytes(arch, s, mlp=True))


def mlp_tile_tokens(arch: Architecture, s: Setup) -> int:
    """Tokens per MLP tile (lowmem_ft/train/tiled_mlp.py mlp_tile_tokens: 0 means hidden_size), at most all tokens."""
    return min(s.tokens, s.mlp_tile_tokens or arch.hidden_size)


def masked_layers(arch: Architecture, s: Setup) -> int:
    """Layers whose SDPA attention is given an explicit mask rather than `is_causal` (transformers 5.24
    masking_utils `_ignore_causal_mask_sdpa`): every layer of a padded batch (micro batch > 1: the collator pads),
    and the sliding-window layers once the sequence reaches the window (`kv_length >= local_attention_size`)."""
    if s.attn_implementation != "sdpa":
        return 0
    if s.micro_batch_size > 1:
        return arch.num_layers
    if arch.sliding_window and s.max_seq_len >= arch.sliding_window:
        return arch.sliding_layers
    return 0


def attention_mask_bytes(arch: Architecture, s: Setup) -> float:
    """The explicit attention masks masking_utils builds once per forward for the masked layers (`masked_layers`):
    bool, b × 1 × s × s, one per kind of layer masked (a padded batch of a model with sliding and full layers gets
    both). Passed to every layer, so alive from the forward to the end of the backward (each checkpoint keeps it).
    Measured (PeakMemory, devkit/long_context_check.py on the Mistral shape with a 4,096-token window, 8,192 tokens,
    checkpointing): 67 MB the model lacked before, 1 B per element; each masked layer's SDPA adds its c-byte additive
    copy beside it (`layer_activation_bytes`, and the forward transient under checkpointing)."""
    n_masked = masked_layers(arch, s)
    if n_masked == 0:
        return 0.0
    kinds = 2 if s.micro_batch_size > 1 and 0 < arch.sliding_layers < arch.num_layers else 1
    return kinds * s.micro_batch_size * s.max_seq_len**2


def layer_activation_bytes(arch: Architecture, s: Setup, masked: bool | None = None) -> float:
    """Bytes one decoder layer keeps for backward per token, without checkpointing (autograd's saved tensors).

    Read from the modeling code (modeling_llama/qwen2 RMSNorm upcast, RoPE, MLP), torch's autograd formulas (a
    frozen weight makes its op keep no input) and peft lora/layer.py Linear.forward (input cast to fp32, dropout
    mask, lora_A input and output); checked against PeakMemory per layer (1- vs 2-layer models,
    benchmarks/estimator_cpu.md:
    exact for full fine-tuning and, with the CPU dropout mask, for LoRA/QLoRA) and across the zoo's families
    (benchmarks/estimator_zoo.md). `masked`: the layer's SDPA gets an explicit mask (see `masked_layers`; default:
    whether any layer does). With `tiled_mlp` the MLP keeps only its input (c·h, the view each tile's checkpoint holds); its own tensors
    exist for one tile at a time in backward (`tiled_mlp_transient_bytes`).
    """
    c = DTYPE_BYTES[s.compute_dtype]
    masked = masked_layers(arch, s) > 0 if masked is None else masked
    total = _norm_bytes(arch, s) + _linear_input_bytes(arch, s) + _attention_bytes(arch, s, masked)
    if arch.moe:
        return total + moe_activation_bytes(arch, s)
    if s.tiled_mlp:  # its input; in a parallel block a full fine-tune's q/k/v keep that norm output already
        # (measured: Cohere h 256, head_dim 96, full, tiled: 12,857 B/token per layer; 13,356 with it counted twice)
        shared = s.adapter == "full" and arch.norms_per_layer == 1
        return total + (0 if shared else c * arch.hidden_size)
    # a full fine-tune's MLP linear inputs were counted with the others (`_linear_input_bytes`)
    return total + mlp_activation_bytes(arch, s)


def _norm_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what a layer's RMSNorms keep (q/k norms included)."""
    c, h = DTYPE_BYTES[s.compute_dtype], arch.hidden_size
    full = s.adapter == "full"
    # RMSNorm: hidden.to(float32) is kept (pow and mul both need it) + rsqrt per token; with a trainable weight the
    # normalized input of `weight *` is kept too: c bytes (Llama: weight * hidden.to(dtype)), or 4 for Gemma's
    # norm, which multiplies in fp32 (modeling_gemma*.py: output * (1.0 + self.weight.float())).
    normalized = (4 if arch.norm_fp32_output else c) * h if full else 0
    total = arch.norms_per_layer * (4 * h + 4 + normalized)
    if s.tiled_norms:  # each norm keeps a view of its c-byte input; under checkpointing the first one's input is the
        # layer input the checkpoint holds already (measured per layer: 1,808 B/token for the probe, tiled MLP and
        # recompute_lora on, without checkpointing)
        total = c * h * (arch.norms_per_layer - (1 if s.gradient_checkpointing else 0))
    # q/k RMSNorm over head_dim (Qwen3, Gemma-3): the fp32 upcast of q and k and an rsqrt per head, as any RMSNorm
    # (measured on the zoo's Qwen3 / Gemma-3: benchmarks/estimator_zoo.md); `memory.tiled_norms` leaves them as are.
    if arch.qk_norm:
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        total += 4 * (q + kv) + 4 * (arch.num_heads + arch.num_kv_heads)
        if full:
            total += (4 if arch.norm_fp32_output else c) * (q + kv)
    return total + centred_norm_extra_bytes(arch, s)


def centred_norm_extra_bytes(arch: Architecture, s: Setup, one_norm: bool = False) -> float:
    """Per token, the second fp32 x − mean copy Cohere's mean-centred LayerNorms keep beyond an RMSNorm's upcast
    (CENTRED_NORM_EXTRA_FP32): the layer's norms (a tiled norm keeps only its input) and q/k norms, or with
    `one_norm` one hidden-sized norm (the final norm, or the first layer's that keeps nothing); 0 for other norms."""
    if arch.norm != "layer_no_bias":
        return 0.0
    norms = 0 if s.tiled_norms else (1 if one_norm else arch.norms_per_layer)
    width = norms * arch.hidden_size
    if arch.qk_norm and not one_norm:
        width += (arch.num_heads + arch.num_kv_heads) * arch.head_dim
    return CENTRED_NORM_EXTRA_FP32 * width


def xielu_extra_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what Apertus's xIELU activation keeps beyond the c·i input a plain activation keeps (XIELU_KEPT_*);
    0 for other activations."""
    if arch.hidden_act != "xielu":
        return 0.0
    c = DTYPE_BYTES[s.compute_dtype]
    kept_c = XIELU_KEPT_C + (XIELU_KEPT_C_TRAINED if s.adapter == "full" else 0)
    return (kept_c * c + XIELU_KEPT_BOOL) * arch.intermediate_size


def _linear_input_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, the linears' kept inputs outside the attention's and the MLP's own tensors. LoRA: peft's. A full
    fine-tune: a trainable weight keeps its input (c bytes), one tensor per input however many linears read it — the
    attention's norm output (q/k/v, fused or not), the MLP's norm output (gate/up; in a parallel block with one norm,
    Cohere / Phi / Falcon, the attention's), each down-projection's own input — while the attention output
    projection's input is the attention output `_attention_bytes` counts, unless it is a copy (`_o_proj_copies`).

    Grouping by (input width, output side) instead merged the MLP's norm output with the attention's input and let
    o_proj's entry (heads·head_dim wide) stand for it: off by c·(hidden − heads·head_dim) per token and layer where
    they differ (Qwen3, Gemma-2/3, Mistral-Nemo), and by c·heads·head_dim with the tiled MLP. Measured per layer with
    PeakMemory (live after the backbone's forward minus static, 3- minus 2-layer models, bf16, 256 tokens, h 256,
    4 heads; tests/memory/test_estimate.py): Llama with head_dim 96 / 32 kept 12,056 / 10,520 B/token where the
    grouping said 12,312 / 10,264, with the tiled MLP 6,424 where it said 7,192; Phi-3 13,976 / 11,160
    where it said 13,464 / 10,648 (its o_proj reads a copy: `_o_proj_copies`)."""
    if s.adapter != "full":
        return _lora_input_bytes(arch, s, mlp=False)
    h = arch.hidden_size
    inputs: dict[str, int] = {}
    for lin in arch.linears:
        if _is_attention_output(arch, lin):
            if _o_proj_copies(arch, s):
                inputs["attention output copy"] = lin.in_features
            continue
        if s.tiled_mlp and is_mlp_linear(arch, lin):
            continue  # the tiled MLP keeps its input itself (`layer_activation_bytes`)
        if lin.name in ATTENTION_INPUT_LINEARS or lin.name == "query_key_value":
            key = "attention norm"
        elif lin.in_features == h:
            key = "attention norm" if arch.norms_per_layer == 1 else "mlp norm"
        else:
            key = lin.name  # a down-projection reads a tensor of its own
        inputs[key] = lin.in_features
    return DTYPE_BYTES[s.compute_dtype] * sum(inputs.values())


def _is_attention_output(arch: Architecture, lin: Linear) -> bool:
    """The attention's output projection (o_proj; `dense` in GPT-NeoX / Falcon / Phi; Qwen v1's attention c_proj)."""
    if lin.name == "c_proj":
        return arch.model_type == "qwen" and not is_mlp_linear(arch, lin)
    return lin.name in ("o_proj", "dense")


# Families whose apply_rotary_pos_emb joins the rotated and passed-through halves with torch.cat (transformers 5.24
# modeling_phi3 / _glm / _glm4 / _nemotron / _gpt_neox; Phi's attention inline): q comes out (batch, heads, seq,
# head_dim)-contiguous rather than a transposed view, and SDPA returns its output in that order.
ROPE_CAT_FAMILIES = frozenset({"phi3", "phi", "glm", "glm4", "nemotron", "gpt_neox"})


def _o_proj_copies(arch: Architecture, s: Setup) -> bool:
    """Whether the output projection's input is a tensor of its own rather than the attention output
    `_attention_bytes` counts. transformers' `attn_output.transpose(1, 2).contiguous()` copies unless the attention
    returned (batch, seq, heads, head_dim) memory order, which it does not for eager attention (its value matmul
    returns (batch, heads, seq, head_dim)) nor for the ROPE_CAT_FAMILIES' queries. Traced on the CPU (does o_proj
    read the SDPA kernel's output storage?): yes for Llama, Qwen3, Cohere, StarCoder2; no for Phi-3, Phi, GLM,
    GLM-4, Nemotron, GPT-NeoX. Measured on Phi-3 (above) and the zoo's Gemma-2 (eager, h 256, 4 × 96, full:
    26,144 B/token kept with its 8,192 of scores, where the grouping, with `_attention_bytes` counting an eager
    output, said 26,400). CUDA's kernels are taken to order their output as the CPU's does (not measured: counting
    the copy is the safe side)."""
    return s.attn_implementation == "eager" or arch.model_type in ROPE_CAT_FAMILIES


def _attention_bytes(arch: Architecture, s: Setup, masked: bool) -> float:
    """Per token, what a layer's attention keeps (its s² eager scores are a term of their own).

    SDPA flash/efficient, or flash_attention_2: q, k, v, output (c bytes) + fp32 logsumexp per head. With an
    explicit mask (padding, or a sliding window the sequence reaches) transformers repeats k/v to all heads
    (sdpa_attention.py repeat_kv, `use_gqa_in_sdpa` needs mask None) and torch's SDPA converts the bool mask to a
    c-byte additive mask (b × 1 × s × s) that each layer's attention keeps: s·c per token (measured 256 B/token at
    s 128, bf16). Eager attention always repeats k/v (eager_attention_forward)."""
    c = DTYPE_BYTES[s.compute_dtype]
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    repeated = masked or s.attn_implementation == "eager"
    kv_kept = q if repeated else kv
    # a fused projection (Phi-3 qkv_proj) hands SDPA views of its one output: v keeps all of it alive
    fused_qkv = any(lin.name in ("qkv_proj", "c_attn") for lin in arch.linears)
    v_kept = q + 2 * kv if fused_qkv and not repeated else kv_kept
    # eager attention's value matmul keeps its inputs, not its output (o_proj's input there is a copy a trained
    # o_proj keeps: `_o_proj_copies`); measured on the zoo's Gemma-2 shape (h 256, 4 × 96, LoRA): 38,016 B/token per
    # layer with its scores, where counting an output said 38,784
    out = 0 if s.attn_implementation == "eager" else q
    return c * (q + out + kv_kept + v_kept) + 4 * arch.num_heads + (c * s.max_seq_len if masked else 0)


def first_layer_discount(arch: Architecture, s: Setup) -> float:
    """Per token, what the first layer does not keep when its input needs no gradient (LoRA without checkpointing:
    frozen embeddings, and `enable_input_require_grads` is only set for checkpointing): the input RMSNorm's fp32
    upcast and rsqrt, and the dropout masks of the attention input projections (`input * noise` keeps the noise
    only for an input that requires grad). Measured: 8203 B/token less for h 512 (= 4·512 + 4 + 3·4·512 + 7)."""
    if s.adapter == "full" or s.gradient_checkpointing:
        return 0.0
    h = arch.hidden_size
    drop = DROPOUT_MASK_BYTES[s.device] if s.lora_dropout > 0 and not s.recompute_lora else 0
    attn_in = sum(lin.in_features for lin in lora_linears(arch, s) if lin.name in ATTENTION_INPUT_LINEARS)
    attn_in += parallel_block_inputs(arch, s)
    # with recompute_lora no mask is kept in any layer; a tiled norm keeps its c-byte input only when it needs grad
    norm = DTYPE_BYTES[s.compute_dtype] * h if s.tiled_norms else 4 * h + 4
    return norm + centred_norm_extra_bytes(arch, s, one_norm=True) + drop * attn_in


def parallel_block_inputs(arch: Architecture, s: Setup) -> int:
    """A parallel block (Cohere: attention and MLP on one `input_layernorm`, the only family with one norm per
    layer) feeds its MLP's input linears the attention's input: per token, their LoRA input widths, whose dropout
    masks the first layer does not keep either (`first_layer_discount`). A full fine-tune's MLP keeps that same norm output
    (`_linear_input_bytes`), not a norm output of its own as a sequential block's does. Measured per layer with PeakMemory (2- vs 3-layer Cohere h 256 models, full fine-tune, 256
    tokens): 15,414 B/token kept, 15,916 with a second norm output; LoRA without checkpointing 0.5 % over the harness's
    peak with the first layer's gate/up masks counted (`scripts/validate_estimator.py --blocks`)."""
    if arch.norms_per_layer != 1:
        return 0
    return sum(lin.in_features for lin in lora_linears(arch, s) if lin.name in ("gate_proj", "up_proj"))


def head_saved_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, kept from the end of forward to the loss's backward: the final RMSNorm (fp32 upcast, rsqrt, and
    its normalized input when trained), the loss input (the fused head's `hidden_states[:, :-1]` is reshaped — a
    c-byte copy — on the CPU, and gathered `hidden_states[mask]` on CUDA), RoPE cos/sin and bookkeeping."""
    c = DTYPE_BYTES[s.compute_dtype]
    h = arch.hidden_size
    norm = c * h if s.tiled_norms else 4 * h + 4 + (c * h if s.adapter == "full" else 0)
    norm += centred_norm_extra_bytes(arch, s, one_norm=True)
    # TRL's fused head and the chunked loss both keep a c-byte copy of the hidden states they project (reshape /
    # `hidden[mask]`); the full-logits loss keeps lm_head's input itself, the final norm's output. The chunked loss's
    # copy and per-label tensors are per labelled position: spread here over every position (× their fraction).
    loss_input = c * h if s.loss_impl == "trl_fused" else 0
    if s.loss_impl == "chunked":
        labelled = s.tokens if s.loss_tokens is None else min(s.loss_tokens, s.tokens)
        loss_input = (c * h + CHUNKED_LABEL_BYTES) * labelled / max(1, s.tokens) + CHUNKED_POSITION_BYTES
    return norm + loss_input + 2 * c * arch.head_dim + TOKEN_BOOKKEEPING_BYTES


def eager_scores_bytes(arch: Architecture, s: Setup) -> float:
    """Per layer, the b·heads·s² scores eager attention keeps (modeling_*.py eager_attention_forward): the softmax's
    fp32 output (`softmax(..., dtype=float32)` saves it) and the c-byte probabilities the value matmul keeps; with
    attention softcapping (Gemma-2) also tanh's c-byte output. Measured on the zoo's Gemma-2
    (benchmarks/estimator_zoo.md)."""
    c = DTYPE_BYTES[s.compute_dtype]
    per_score = 4 + c + (c if arch.attn_logit_softcapping else 0)
    return per_score * arch.num_heads * s.micro_batch_size * s.max_seq_len**2


def loss_positions(s: Setup) -> int:
    """Positions the chunked loss projects (losses.py `token_log_probs`: `hidden[mask]`): the micro batch's labelled
    positions when known (`Setup.loss_tokens`), else every position but each row's last, the upper bound."""
    n = s.micro_batch_size * (s.max_seq_len - 1)
    return n if s.loss_tokens is None else max(0, min(n, s.loss_tokens))


def loss_chunk_tokens(arch: Architecture, s: Setup) -> int:
    """Tokens per chunk of the chunked loss: `memory.loss_chunk_tokens`, else losses.py's 64 MiB of fp32 logits; at
    most the positions it projects (`loss_positions`)."""
    n = loss_positions(s)
    return max(1, min(n, s.loss_chunk_tokens or CHUNK_FP32_BYTES // (4 * arch.vocab_size)))


def _chunk_per_logit(arch: Architecture, s: Setup) -> tuple[int, int]:
    """(forward, backward) bytes per logit of one loss chunk (CHUNK_*_BYTES_PER_LOGIT)."""
    c = DTYPE_BYTES[s.compute_dtype]
    if arch.final_logit_softcapping:
        fwd = CHUNK_FWD_BYTES_PER_LOGIT_SOFTCAP_FP32 if c == 4 else CHUNK_FWD_BYTES_PER_LOGIT
        return fwd, CHUNK_BWD_BYTES_PER_LOGIT_SOFTCAP
    return CHUNK_FWD_BYTES_PER_LOGIT, CHUNK_BWD_BYTES_PER_LOGIT + (c if c < 4 else 0)


def _chunk_backward_fixed(arch: Architecture, s: Setup) -> float:
    """The chunked loss's backward beyond its chunk: every projected token's c-byte hidden-state gradient and fp32
    ones."""
    n = loss_positions(s)
    return (DTYPE_BYTES[s.compute_dtype] * arch.hidden_size + CHUNK_BWD_BYTES_PER_TOKEN) * n


def chunk_forward_bytes(arch: Architecture, s: Setup, k: int) -> float:
    """The chunked loss's forward working set for chunks of `k` tokens."""
    return _chunk_per_logit(arch, s)[0] * k * arch.vocab_size


def chunk_backward_bytes(arch: Architecture, s: Setup, k: int) -> float:
    """The chunked loss's backward working set: one chunk of `k` tokens and every token's gradients."""
    return _chunk_per_logit(arch, s)[1] * k * arch.vocab_size + _chunk_backward_fixed(arch, s)


def largest_loss_chunk(arch: Architecture, s: Setup, budget_bytes: float) -> int:
    """The largest loss chunk (tokens) whose working set, forward and backward, fits in `budget_bytes`; 0 if even
    one token does not. At most the micro batch's tokens. Pure arithmetic, for the planner: fewer, larger chunks
    when there is room (`memory.loss_chunk_tokens`)."""
    n = loss_positions(s)
    fwd, bwd = _chunk_per_logit(arch, s)
    k = min(
        budget_bytes // (fwd * arch.vocab_size),
        (budget_bytes - _chunk_backward_fixed(arch, s)) // (bwd * arch.vocab_size),
    )
    return int(max(0, min(n, k)))


def loss_bytes(arch: Architecture, s: Setup) -> tuple[float, float, str]:
    """(forward, backward) working sets of the logits and the loss, beyond what `head_saved_bytes` keeps."""
    c = DTYPE_BYTES[s.compute_dtype]
    n = s.micro_batch_size * (s.max_seq_len - 1)
    v, h = arch.vocab_size, arch.hidden_size
    trained_head = s.adapter == "full"
    if s.loss_impl == "hf_full":
        b = n * v * (c + HF_LOSS_BYTES_PER_LOGIT)
        return b, b, "full logits + fp32 upcast, log_softmax and grad (ForCausalLMLoss)"
    if s.loss_impl == "chunked":
        k = loss_chunk_tokens(arch, s)
        return (
            chunk_forward_bytes(arch, s, k),
            chunk_backward_bytes(arch, s, k),
            f"one chunk of {k} tokens × vocab (lowmem_ft/train/losses.py) + the hidden-state gradient",
        )
    rows, cols = min(n, TRL_TOKEN_CHUNK), min(v, TRL_VOCAB_CHUNK)
    tile = rows * cols
    mm_buf = c * rows * TRL_VOCAB_CHUNK
    # backward accumulators, fp32 (ChunkedLogProbFunction.backward): grad_hidden N × h; grad_weight V × h if trained
    acc = 4 * n * h + (4 * v * h if trained_head else 0)
    # on return, the c-byte casts of the accumulators (`grad_hidden.to(hidden.dtype)`, `grad_weight.to(...)`)
    tail = c * n * h + (c * v * h if trained_head else 0)
    if s.device == "cpu":
        fwd = mm_buf + 4 * CPU_TILE_FP32_FWD * tile
        addmm = 4 * tile + 4 * cols * h + (4 * rows * h if trained_head else 0)
        # final-logit softcapping keeps tanh's fp32 output `t` beside y and z through the fold (_backward_tile)
        tiles_bwd = CPU_TILE_FP32_BWD + (1 if arch.final_logit_softcapping else 0)
        bwd = acc + mm_buf + max(4 * tiles_bwd * tile, addmm, tail)
        where = "CPU torch fold: fp32 tile copies (3.25 fwd, 7.25 bwd)"
    else:
        fwd, bwd = mm_buf, acc + mm_buf + tail
        where = "Triton fold: no fp32 tile copies"
    return fwd, bwd, f"TRL fused LM head: {rows} × 32768 tile buffer, fp32 accumulators; {where}"


def effective_setup(arch: Architecture, s: Setup) -> tuple[Setup, str | None]:
    """The setup as it runs on this architecture: the attention implementation the family supports when
    transformers refuses the requested one (`Architecture.attention_for`, applied at load by
    `lowmem_ft.train.model.attention`), and why it changed (None when it did not)."""
    used, why = arch.attention_for(s.attn_implementation)
    return (s if used == s.attn_implementation else replace(s, attn_implementation=used)), why


def _static_components(arch: Architecture, s: Setup) -> tuple[list[Component], list[str], list[tuple[int, int]]]:
    """Weights, trainable parameters, their gradients and optimizer states (static), and what lives on the host."""
    c = DTYPE_BYTES[s.compute_dtype]
    comps: list[Component] = []
    notes: list[str] = []
    w_lin, w_rest, w_desc = weight_bytes(arch, s)
    comps.append(Component("base weights (linears)", w_lin, "static", w_desc))
    rest_what = "embeddings + lm_head" if not arch.tie_embeddings else "tied embeddings (once)"
    if s.embeddings_on_host and not arch.tie_embeddings and s.adapter == "lora":
        # lowmem_ft/train/host_embeddings.py: the frozen table stays in host memory, the lookup runs there
        host = c * arch.embedding_params
        w_rest -= host
        rest_what = "lm_head"
        comps.append(Component("input embeddings (host)", host, "host", "memory.embeddings_on_host: CPU lookup"))
    if arch.moe:  # the expert stacks and routers are not nn.Linear: bitsandbytes leaves them in the compute dtype
        experts = c * arch.num_layers * (arch.moe.layer_params(arch.hidden_size) - arch.moe.extra_norm_params)
        w_rest -= experts
        comps.append(Component("experts + routers (16-bit)", experts, "static", MOE_WEIGHTS_SOURCE))
    comps.append(Component(f"16-bit {rest_what}, norms", w_rest, "static", "kept in compute dtype (not quantized)"))
    trainable = _trainable_tensors(arch, s)
    n_train = sum(n for n, _ in trainable)
    if s.adapter == "lora":
        comps.append(Component("LoRA parameters (fp32)", 4 * n_train, "static", "peft autocast_adapter_dtype=True"))
    grads = sum(n * e for n, e in trainable)
    comps.append(Component("gradients", grads, "static", "one per trainable parameter, in its dtype"))
    fp32_states = trainer_fp32_states(arch, s)
    states, paged = optimizer_state_bytes(trainable, s.optimizer, s.device, fp32_states)
    comps.append(Component(f"optimizer states ({s.optimizer})", states, "static", "bitsandbytes / torch init_state"))
    held = s.gradient_accumulation + (1 if s.device == "cpu" else 0)
    comps.append(Component(BATCH, BATCH_BYTES_PER_TOKEN * s.tokens * held, "static",
                           f"{held} micro batches × int64 ids, labels, mask (the accumulation window"
                           + (" + the loader's next one)" if s.device == "cpu" else ")")))  # fmt: skip
    if paged:
        comps.append(Component("paged optimizer states", paged, "host", "bnb paged memory: evicted under pressure"))
        notes.append(f"{paged / GB:.2f} GB of optimizer state is paged (unified memory) and not counted in the peak")
    return comps, notes, trainable


def tiled_mlp_transient_bytes(arch: Architecture, s: Setup) -> float:
    """With `tiled_mlp`, the MLP's backward working set beyond the layer's saved tensors: one tile's recomputed MLP
    tensors and TILE_BWD_I·i B per tile token of gradients, beside the tiles' input gradients (c·h per token)."""
    c = DTYPE_BYTES[s.compute_dtype]
    tile = mlp_tile_tokens(arch, s)
    if s.tiled_norms:
        return tile * (mlp_activation_bytes(arch, s) + TILE_BWD_I_TILED_NORMS * arch.intermediate_size)
    per_tile_token = mlp_activation_bytes(arch, s) + TILE_BWD_I * arch.intermediate_size
    return tile * per_tile_token + c * arch.hidden_size * s.tokens


def forward_transient_bytes(arch: Architecture, s: Setup) -> float:
    """The largest transient of one layer's forward beyond what the layers keep (FWD_TRANSIENT_* and FWD_BESIDE_*,
    measured at the layers' own peak): peft's fp32 copies around the adapted linear with the widest input, beside
    the hidden-sized tensors in flight. With `tiled_mlp` the MLP's linears see one tile at a time, under the tile's
    checkpoint (nothing kept), beside the tile outputs gathered so far, the residual sum and the MLP input (3·c·h
    per token: the forward of the yardstick's 1,024-token-tile points, where this moment is the peak, is exact on
    the three shapes); under checkpointing the attention's output projection is the other moment
    (`_attention_output_bytes`). RoPE's cos/sin, which also exist while the layers run, are the caller's
    (`_forward_backward`)."""
    if arch.moe:  # the experts' moment, or the attention's (whose LoRA copies are measured as for dense blocks)
        moments = max(moe_forward_transient_bytes(arch, s), _dense_forward_transient_bytes(arch, s))
        return moments + unused_sliding_mask_bytes(arch, s)
    return _dense_forward_transient_bytes(arch, s)


def _dense_forward_transient_bytes(arch: Architecture, s: Setup) -> float:
    """`forward_transient_bytes` of a block with a dense MLP (or the attention's moment of an MoE block)."""
    if s.adapter == "full":
        return 0.0
    c = DTYPE_BYTES[s.compute_dtype]
    h, t = arch.hidden_size, s.tokens
    drop = DROPOUT_MASK_BYTES[s.device] if s.lora_dropout > 0 else 0
    lins = lora_linears(arch, s)
    if s.recompute_lora:
        return recompute_forward_transient_bytes(arch, s, lins) + FWD_TOKEN_STATS_BYTES * t
    outside = [lin for lin in lins if not (s.tiled_mlp and is_mlp_linear(arch, lin))]
    wide = max(outside, key=lambda lin: lin.in_features, default=None)
    wide_in = wide.in_features if wide else 0
    if s.gradient_checkpointing:
        transient = ((c + drop + FWD_TRANSIENT_CKPT) * wide_in + FWD_BESIDE_CKPT * c * h) * t
        if s.tiled_mlp:
            transient = max(transient, _attention_output_bytes(arch, s, (drop + FWD_TRANSIENT_CKPT) * wide_in))
    elif s.tiled_mlp:  # the attention's linears, with two hidden-sized tensors beside (measured)
        transient = ((c + drop + FWD_TRANSIENT_NO_CKPT) * wide_in + 2 * c * h) * t
    else:
        beside = FWD_BESIDE_NO_CKPT_TILED_NORMS if s.tiled_norms else FWD_BESIDE_NO_CKPT
        wide_out = wide.out_features if wide else 0
        transient = ((c + FWD_TRANSIENT_NO_CKPT) * wide_in + (c + FWD_OUTPUT_FP32) * wide_out + beside * c * h) * t
    if s.tiled_mlp:
        inside = max((lin.in_features for lin in lins if is_mlp_linear(arch, lin)), default=0)
        tile = mlp_tile_tokens(arch, s)
        transient = max(transient, (c + drop + FWD_TRANSIENT_CKPT) * inside * tile + 3 * c * h * t)
    return transient + FWD_TOKEN_STATS_BYTES * t


def _attention_output_bytes(arch: Architecture, s: Setup, lora_copies: float) -> float:
    """Under checkpointing with `tiled_mlp`: the moment of the attention's output projection — q, k, v and the
    attention output (c bytes each), the norm output and the projection's base output (c·h each) and its LoRA
    copies (`lora_copies` bytes per token; measured, see FWD_TRANSIENT_CKPT)."""
    c = DTYPE_BYTES[s.compute_dtype]
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return (c * (2 * q + 2 * kv) + 2 * c * arch.hidden_size + lora_copies) * s.tokens


def masked_attention_forward_bytes(arch: Architecture, s: Setup) -> float:
    """Under checkpointing, a masked layer's SDPA moment (`masked_layers`; 0 when none): the c-byte additive mask
    SDPA makes from the bool one (b × s × s, kept per layer when not checkpointing: `_attention_bytes`), beside q, k,
    v and the output (c each; with GQA `repeat_kv` adds k and v expanded to every head), the norm output (c·h), the
    logsumexp (fp32 per head) and the per-token statistics. Measured at the layers' peak (PeakMemory, op
    attribution) on the yardstick's Mistral shape with a 2,048-token window at 4,096 tokens: 9,820 B/token, exact;
    the repeated k/v are read from transformers' sdpa_attention.py, not measured. The additive mask lives only
    through SDPA, so this is a moment of its own, not added to the layer's other transients."""
    if not (s.gradient_checkpointing and masked_layers(arch, s)):
        return 0.0
    c, t = DTYPE_BYTES[s.compute_dtype], s.tokens
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    repeated = 2 * q if kv < q else 0
    tensors = c * (2 * q + 2 * kv + repeated + arch.hidden_size) + 4 * arch.num_heads + FWD_TOKEN_STATS_BYTES
    return c * s.micro_batch_size * s.max_seq_len**2 + tensors * t


def final_norm_forward_bytes(arch: Architecture, s: Setup) -> float:
    """The final RMSNorm's forward beside what the layers keep: the last layer's output (its input) and, without
    checkpointing, the model's input embeddings (its forward holds `inputs_embeds`; under checkpointing they are the
    first layer's kept input), then the fp32 upcast, the normalized fp32 copy, its cast back and the weighted output
    (4 + 4 + c + c per element; Gemma's norm multiplies in fp32 and casts once: 4 + 4 + 4 + c) and the per-token mean
    and rsqrt. Measured at the forward's peak with PeakMemory (op attribution): 2,056 B/token on the Llama-shaped
    yardstick model (h 128) without checkpointing, where it is above the loss's forward. A tiled norm's fp32 copies
    exist for one tile at a time (0: the layers' or the loss's moment is larger)."""
    if s.tiled_norms:
        return 0.0
    c, h = DTYPE_BYTES[s.compute_dtype], arch.hidden_size
    stream = c * h * (1 if s.gradient_checkpointing else 2)
    copies = (12 + c if arch.norm_fp32_output else 8 + 2 * c) * h
    return (stream + copies + FWD_TOKEN_STATS_BYTES) * s.tokens


def recompute_forward_transient_bytes(arch: Architecture, s: Setup, lins: list[Linear]) -> float:
    """With `recompute_lora` the fp32 input copies live inside each branch's tile; what remains is output-side: the
    base layer's c-byte output and the branch's fp32 tile outputs and their concatenation (FWD_TRANSIENT_CKPT bytes
    per output element; peft's plain Linear then adds them in fp32), for the adapted linear with the widest output,
    beside one c-byte tensor of the widest live activation and the two hidden-sized ones of FWD_BESIDE_CKPT. Without
    checkpointing part of the fp32 output is kept already (FWD_TRANSIENT_NO_CKPT), beside three c-byte hidden-sized
    tensors (one with tiled MLP and norms: the rest are the tiled norms' kept inputs). With `tiled_mlp` under
    checkpointing the attention's output projection is the larger moment; one MLP tile's moment as in
    `forward_transient_bytes`. Measured as FWD_TRANSIENT_CKPT says: within 4 B/token on the three shapes."""
    c = DTYPE_BYTES[s.compute_dtype]
    h, t = arch.hidden_size, s.tokens
    outside = [lin for lin in lins if not (s.tiled_mlp and is_mlp_linear(arch, lin))]
    widest = max((lin.out_features for lin in outside), default=0)
    live = max([h] + [arch.intermediate_size for lin in outside if is_mlp_linear(arch, lin)])
    if s.gradient_checkpointing:
        transient = ((c + FWD_TRANSIENT_CKPT) * widest + c * live + (FWD_BESIDE_CKPT - 1) * c * h) * t
        if s.tiled_mlp:
            transient = max(transient, _attention_output_bytes(arch, s, FWD_TRANSIENT_CKPT * h))
    else:
        beside = 1 if s.tiled_mlp and s.tiled_norms else 3
        transient = ((c + FWD_TRANSIENT_NO_CKPT) * widest + beside * c * h) * t
    if s.tiled_mlp:
        inside = max((lin.out_features for lin in lins if is_mlp_linear(arch, lin)), default=0)
        tile = mlp_tile_tokens(arch, s)
        i = arch.intermediate_size
        transient = max(transient, ((c + FWD_TRANSIENT_CKPT) * inside + c * i) * tile + 3 * c * h * t)
    return transient


def backward_transient_bytes(arch: Architecture, s: Setup) -> tuple[float, str]:
    """Gradients in flight at the backward's peak beyond the saved tensors, and where the figure comes from: with
    checkpointing, the recomputed layer's; without, the final norm's fp32 backward (all measured, see the constants)."""
    h, i, t = arch.hidden_size, arch.intermediate_size, s.tokens
    if arch.moe:
        return moe_backward_transient_bytes(arch, s)
    tile = mlp_tile_tokens(arch, s)
    if s.gradient_checkpointing:
        if s.tiled_mlp:
            attn_h = TILED_RECOMPUTE_BWD_H
            if s.tiled_norms:
                attn_h = TILED_NORMS_RECOMPUTE_BWD_H if s.recompute_lora else TILED_NORMS_BWD_H
            grads = max(attn_h * h * t, tiled_mlp_transient_bytes(arch, s))
            return grads, f"attention gradients or one MLP tile of {tile} tokens (measured)"
        bwd_i = RECOMPUTE_BWD_I_LORA_RECOMPUTED if s.recompute_lora and s.adapter == "lora" else RECOMPUTE_BWD_I
        return (bwd_i * i + RECOMPUTE_BWD_H * h) * t, "recomputed layer's MLP/LoRA gradients (measured)"
    grads = NORM_BWD_BYTES_PER_H * h * (tile if s.tiled_norms else t)
    if s.tiled_mlp:  # the last layer's MLP tiles are recomputed while every layer's activations are kept
        return max(grads, tiled_mlp_transient_bytes(arch, s)), "final RMSNorm backward or one MLP tile (measured)"
    return grads, "final RMSNorm backward, fp32 (measured)"


def _activations(arch: Architecture, s: Setup, comps: list[Component]) -> tuple[float, float]:
    """(kept for backward, one layer's activations) of the decoder layers, their components appended to `comps`.

    Layers whose attention gets an explicit mask keep more (see `masked_layers`); checkpointing keeps each layer's
    input and recomputes the largest layer, without it every layer's activations are kept; eager attention adds its
    s² scores to either."""
    c, t = DTYPE_BYTES[s.compute_dtype], s.tokens
    n_masked = masked_layers(arch, s)
    layer = layer_activation_bytes(arch, s, masked=n_masked > 0) * t
    mask = attention_mask_bytes(arch, s)
    if mask:
        comps.append(Component("attention masks (s², bool)", mask, "forward/backward", "masking_utils sdpa_mask"))
    all_layers = n_masked * layer + (arch.num_layers - n_masked) * layer_activation_bytes(arch, s, masked=False) * t
    if s.gradient_checkpointing:
        boundary = c * arch.hidden_size * t  # a decoder layer's input, what a checkpoint keeps
        kept = 0.0 if s.activation_offloading else arch.num_layers * boundary
        label = "checkpointed layer inputs" + (" (offloaded to host)" if s.activation_offloading else "")
        comps.append(Component(label, kept, "forward/backward", "non-reentrant checkpoint keeps each layer's input"))
        if s.activation_offloading:
            comps.append(Component("offloaded layer inputs", arch.num_layers * boundary, "host", "save_on_cpu"))
        comps.append(Component("one layer's activations (recompute)", layer, "forward/backward", "recomputed in bwd"))
    else:
        kept = all_layers - first_layer_discount(arch, s) * t
        comps.append(Component("activations, all layers", kept, "forward/backward", "autograd saved tensors"))
    if s.attn_implementation == "eager":
        eager = eager_scores_bytes(arch, s) * (1 if s.gradient_checkpointing else arch.num_layers)
        comps.append(Component("eager attention scores (s²)", eager, "forward/backward", "softmax probs kept"))
        if not s.gradient_checkpointing:
            kept += eager
        else:
            layer += eager
    return kept + mask, layer


def _forward_backward(arch: Architecture, s: Setup, comps: list[Component]) -> tuple[float, float]:
    """Appends the activation, loss and backward components; returns (forward peak, backward peak) above static."""
    c = DTYPE_BYTES[s.compute_dtype]
    t = s.tokens
    h = arch.hidden_size
    # what the forward keeps for backward (`kept`), then the largest transient on top of it
    kept, layer = _activations(arch, s, comps)
    head = head_saved_bytes(arch, s) * t
    comps.append(Component("final norm + loss input", head, "forward/backward", "RMSNorm upcast, head input, RoPE"))
    kept += head
    loss_fwd, loss_bwd, loss_src = loss_bytes(arch, s)
    comps.append(Component("logits / loss working set", max(loss_fwd, loss_bwd), "forward/backward", loss_src))
    grads_in_flight, bwd_src = backward_transient_bytes(arch, s)
    layer_bwd = layer + grads_in_flight if s.gradient_checkpointing else grads_in_flight
    comps.append(Component("backward gradient buffers", grads_in_flight, "forward/backward", bwd_src))
    dequant = 0.0
    if s.quantization in ("nf4", "int8"):
        dequant = c * max(lin.in_features * lin.out_features for lin in arch.linears)
        comps.append(Component("dequantization buffer", dequant, "forward/backward", "largest linear in 16-bit"))
    # Full fine-tuning: the embedding's dense backward makes a new c-byte V × h gradient beside the accumulated one,
    # and the CPU measurement shows about two such buffers at the end of the backward (embedding_dense_backward).
    embed_bwd = 2 * c * arch.vocab_size * h if s.adapter == "full" else 0.0
    # the chunked loss copies the final norm's output (`hidden[mask]`), which itself stays alive through the loss's
    # forward (the model's `hidden_states`; PeakMemory, tiny-model runs at 4,096 tokens with and without tiled norms)
    head_out = c * h * t if s.tiled_norms or s.loss_impl == "chunked" else 0.0
    # The forward peaks in one of three places: the last decoder layer, beside everything the layers keep and RoPE's
    # cos/sin (the final norm, the loss input and the loss's bookkeeping do not exist yet); the final norm
    # (`final_norm_forward_bytes`); the head and loss, beside the head's saved tensors. Measured apart with
    # PeakMemory's window read by a forward pre-hook on the final norm (the layers' peak alone), attributed op by op.
    rope = 2 * c * arch.head_dim * t
    layer_fwd = rope + max(forward_transient_bytes(arch, s), masked_attention_forward_bytes(arch, s))
    fwd_peak = kept - head + max(head + loss_fwd + head_out, layer_fwd, rope + final_norm_forward_bytes(arch, s))
    bwd_peak = max(kept + loss_bwd, kept + layer_bwd + dequant, embed_bwd + c * h * t)
    return fwd_peak, bwd_peak


def estimate(arch: Architecture, s: Setup) -> Estimate:
    """Named components of the peak, and the peak itself (see the module docstring for how they combine)."""
    s, attention_note = effective_setup(arch, s)
    comps, notes, trainable = _static_components(arch, s)
    if attention_note:
        notes.insert(0, f"attention: {attention_note}")
    static = sum(x.bytes for x in comps if x.phase == "static")
    fwd_peak, bwd_peak = _forward_backward(arch, s, comps)
    fwd_bwd = max(fwd_peak, bwd_peak)

    step_temp, step_src = optimizer_step_temp(trainable, s.optimizer, s.device, trainer_fp32_states(arch, s))
    comps.append(Component("optimizer step temporaries", step_temp, "optimizer step", step_src))

    model_peak = static + max(fwd_bwd, step_temp)
    phase = "forward/backward" if fwd_bwd >= step_temp else "optimizer step"
    phases = {"static": static, "forward": static + fwd_peak, "backward": static + bwd_peak}
    phases["optimizer step"] = static + step_temp
    overhead = 0.0
    if s.device == "cuda":
        alloc = ALLOCATOR_FRACTION * max(fwd_bwd, step_temp)
        comps.append(Component("CUDA context", CUDA_CONTEXT_BYTES, "overhead", "assumed (see CUDA_CONTEXT_BYTES)"))
        comps.append(Component("cuBLAS workspaces", CUBLAS_WORKSPACE_BYTES, "overhead", "torch CublasHandlePool"))
        comps.append(Component("allocator rounding/fragmentation", alloc, "overhead", "10% of transient peak"))
        overhead = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + alloc
    return Estimate(comps, s, model_peak, overhead, phase, notes, phases)


def eval_mlp_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, the MLP's tensors in flight without autograd (evaluation), at its peak.

    Gated: act(gate) is alive while `up_proj` runs; a plain up_proj leaves act(gate), up and their product (3·c·i). A
    LoRA `up_proj` (peft lora/layer.py Linear.forward: `result + lora_B(lora_A(x)) * scaling`) holds its base output
    (c·i) and lora_B's fp32 output and its scaled copy (4 + 4 B) beside act(gate): (2·c + 8)·i. Measured with
    PeakMemory on Qwen2MLP (i 16384, under no_grad): 12.0 / 6.0 B per i-element (plain, fp32 / bf16), 16.0 / 12.06
    (LoRA on gate/up/down). The fused gate_up_proj (Phi-3) doubles the LoRA part (read from the code, unmeasured);
    a plain (non-gated) MLP holds its up output and the activation (2·c·i), or a LoRA up_proj's three tensors.
    """
    c, i = DTYPE_BYTES[s.compute_dtype], arch.intermediate_size
    if arch.moe:
        return moe_eval_bytes(arch, s)
    adapted = {lin.name for lin in lora_linears(arch, s)} if s.adapter == "lora" else set()
    if "gate_up_proj" in adapted:
        return (2 * c + 16) * i
    if arch.mlp == "gated":
        return (2 * c + 8) * i if "up_proj" in adapted else 3 * c * i
    return (c + 8) * i if adapted & {"up_proj", "fc1", "c_fc"} else 2 * c * i


def eval_peak_bytes(arch: Architecture, s: Setup, batch: int) -> float:
    """Peak of one evaluation forward during training, overheads included: the eval batch size's memory.

    Evaluation runs under `torch.no_grad()` between optimizer steps, so the static memory is the training one minus
    the gradients (transformers' Trainer zeroes them with `set_to_none`), and nothing is kept for backward: the
    working set is one layer's tensors in flight (bounded by what that layer saves when training — the same
    tensors, created and freed in turn), the residual stream and layer output, the final norm and loss input, and
    the forward of the loss (TRL's fused head also runs in evaluation). The layer and the loss peak one after the
    other, not together; checked against exact CPU measurements of real runs' evaluations (`lowmem_ft.train.exact`).
    """
    train = estimate(arch, s)
    s, _ = effective_setup(arch, s)
    static = sum(x.bytes for x in train.components if x.phase == "static" and x.name != "gradients")
    # an evaluation batch's labelled positions are not known: every position (`loss_tokens` None)
    es = replace(
        s,
        micro_batch_size=batch,
        gradient_checkpointing=False,
        activation_offloading=False,
        lora_dropout=0.0,
        loss_tokens=None,
    )
    c, t = DTYPE_BYTES[s.compute_dtype], es.tokens
    loss_fwd, _, _ = loss_bytes(arch, es)
    dequant = c * max(x.in_features * x.out_features for x in arch.linears) if s.quantization != "none" else 0.0
    # Without autograd nothing outlives its layer: the peak is one layer's tensors in flight (beside the dequantized
    # weight), or later the loss's forward beside the final norm and loss input — never both (measured with the
    # exact CPU count of real runs' evaluations, lowmem_ft.train.exact: summing them over-predicted by up to 25 %).
    # With tiled_mlp the MLP's tiles run one after another: one tile's MLP tensors at a time.
    mlp = eval_mlp_bytes(arch, es) * (mlp_tile_tokens(arch, es) if es.tiled_mlp else t)
    layer = max(layer_activation_bytes(arch, es) * t, mlp) + 2 * c * arch.hidden_size * t
    transient = max(layer + dequant, head_saved_bytes(arch, es) * t + loss_fwd) + attention_mask_bytes(arch, es)
    transient += BATCH_BYTES_PER_TOKEN * t * (2 if s.device == "cpu" else 1)  # the eval batch (+ the loader's next)
    overhead = 0.0
    if s.device == "cuda":
        overhead = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + ALLOCATOR_FRACTION * transient
    return static + transient + overhead


# -- the phases of a real run (the CPU monitor's prediction) ------------------------------------------------------
RunPhase = Literal["forward", "backward", "optimizer step", "eval"]


def phase_peak_bytes(
    arch: Architecture, s: Setup, phase: RunPhase, *, grads: bool = True, states: bool = True, ddp: bool = False
) -> float:
    """Live tensor bytes at the peak of one phase of a training run, for a batch of `s.micro_batch_size` rows ×
    `s.max_seq_len` tokens: what the monitor's exact CPU measurement (`lowmem_ft.train.exact`) is compared with.

    `estimate` gives the steady state, where every static component is alive in every phase. A real run is not
    always there: transformers' Trainer frees the gradients after each optimizer step (`model.zero_grad()`, set to
    None), so the first forward of each optimizer step runs without them (`grads=False`), and the optimizer creates
    its states in its first step (`states=False` before it). The backward always counts the gradients: they are
    complete when it ends. `eval` is `eval_peak_bytes` (no gradients). `ddp`: one process of several, whose
    gradients lowmem-ft's trainer averages with one flat all-reduce before the optimizer step
    (`lowmem_ft.train.trainer` `_average_gradients`: a flat copy of every gradient, freed before the step). The CPU
    form only (`s.device == "cpu"`): on CUDA the same phases carry device overheads the monitor reads from the
    allocator instead.
    """
    if s.device != "cpu":
        raise ValueError("phase_peak_bytes is the CPU form (live tensor bytes, no device overheads)")
    est = estimate(arch, s)
    absent = 0.0
    if not states:
        absent += sum(c.bytes for c in est.components if c.name.startswith("optimizer states"))
    if phase == "eval":
        return eval_peak_bytes(arch, s, s.micro_batch_size) - absent
    gradients = est.by_name()["gradients"]
    if not grads and phase == "forward":
        absent += gradients
    if ddp and phase == "optimizer step":
        return max(est.phases[phase], est.phases["static"] + gradients) - absent
    return est.phases[phase] - absent


# -- mixtures of experts (lowmem_ft/memory/arch.py `MoE`) ----------------------------------------------------------
# What one MoE block keeps for backward with frozen experts (LoRA / QLoRA: transformers 5.24's default
# `grouped_mm_experts_forward`, integrations/moe.py), per token, k = top-k routed experts, E experts, I one expert's
# width: the router's fp32 softmax output (4·E; Granite-MoE softmaxes the top-k logits only: 4·k), its int64 top-k
# indices (8·k), with Mixtral's renormalisation the fp32 top-k values and their sum (4·k + 4); per routed copy
# (k per token) the sort permutation and its `// k` gather index and the inverse permutation (3 × int64), the
# up-projection's output (c·2I: act(gate) keeps it, `up` is a view of it), act(gate) (c·I), the down-projection's
# output (c·h, kept by the weighting product) and the routing weight (fp32 for Mixtral, else c). A frozen expert
# stack makes `grouped_mm` keep no input: neither the gathered hidden states nor act(gate)·up. Read from the code and
# measured exactly with saved_tensors_hooks on one block (Mixtral k 2/E 8, Qwen3-MoE k 4/E 16, Granite-MoE k 2/E 8;
# 2,676.06 / 3,784.13 / 2,636.06 B per token at h 256) and as per-layer differences of whole runs (PeakMemory, 1- vs
# 2-layer models, devkit/moe_check.py).
MOE_INDEX_BYTES = 3 * 8
MOE_WEIGHTS_SOURCE = "3-D expert parameters + router: bnb replaces nn.Linear only (integrations/bitsandbytes.py)"
# Qwen2-MoE's shared expert (modeling_qwen2_moe.py: `sigmoid(shared_expert_gate(x)) * shared_expert(x)`): beside
# its dense MLP's terms the product keeps the shared expert's c-byte output and the c-byte sigmoid (per token), and
# that output is alive through the routed experts' moments (SHARED_BESIDE_H); Granite-MoE (`inputs_embeds *
# embedding_multiplier`) holds the unscaled embeddings beside the scaled first-layer input through the forward,
# and one more hidden-sized tensor is in flight in the recomputed layer's backward (GRANITE_BESIDE_H). Measured on
# the layers' windows (devkit/moe_check.py): −2,013 / −993 B/token (Qwen2-MoE without / with checkpointing) and
# −481 / −496 (Granite-MoE, checkpointing) before these terms.
SHARED_GATE_KEPT_H, SHARED_BESIDE_H = 1, 1
GRANITE_BESIDE_H = 1


def moe_router_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what the router keeps (see MOE_INDEX_BYTES)."""
    moe = arch.moe
    assert moe is not None
    probs = 4 * (moe.top_k if moe.routing == "topk_softmax" else moe.experts)
    renorm = 4 * moe.top_k + 4 if moe.routing.startswith("fp32_renorm") else 0
    return probs + 8 * moe.top_k + renorm


def moe_routed_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what the routed experts keep with frozen weights: per routed copy the indices, c·2I, c·I, c·h and
    the routing weight (see MOE_INDEX_BYTES)."""
    moe = arch.moe
    assert moe is not None
    c = DTYPE_BYTES[s.compute_dtype]
    weight = 4 if moe.routing == "fp32_renorm" else c
    per_copy = MOE_INDEX_BYTES + 3 * c * moe.intermediate_size + c * arch.hidden_size + weight
    return moe.top_k * per_copy


def moe_activation_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, what one MoE block keeps for backward: the shared expert's (Qwen2-MoE: a dense gated MLP with its
    LoRA inputs, as `mlp_activation_bytes`), the router's and the routed experts' (measured, see MOE_INDEX_BYTES)."""
    moe = arch.moe
    assert moe is not None
    c = DTYPE_BYTES[s.compute_dtype]
    shared = 0.0
    if moe.shared_intermediate:
        shared = 3 * c * moe.shared_intermediate + (0 if s.adapter == "full" else _lora_input_bytes(arch, s, mlp=True))
        shared += SHARED_GATE_KEPT_H * c * arch.hidden_size + 2 * c
    return shared + moe_router_bytes(arch, s) + moe_routed_bytes(arch, s)


# The experts' transient moments (integrations/moe.py `grouped_mm_experts_forward`; k routed copies per token, w the
# routing weight's bytes: 4 for Mixtral's fp32 weights, else c), per token, attributed op by op with a PeakMemory
# subclass on one block (devkit/moe_check.py shapes) and checked on whole runs' layer windows:
# - forward: the up-projection's moment — the gathered hidden states (c·h, a local the function holds to its end),
#   its c·2I output, act(gate) and the act·up product (c·I each) — or the un-permute's — the gathered states, the
#   down-projection's output (c·h), the weighted copy and its un-permuted copy (w·h each). Without checkpointing the
#   up-projection's output, act(gate) and the down output are kept already, so only the gathered states and product
#   (or the two weighted copies) are extra. Beside them the layer's hidden-sized tensors: the residual sum and the
#   block's input (checkpointing: MOE_FWD_BESIDE_CKPT), and also the model's input embeddings and the layer's input
#   without (MOE_FWD_BESIDE_NO_CKPT: four, as FWD_BESIDE_NO_CKPT for dense blocks); the routing
#   indices in flight (sort values and permutation, the histc float copy, an arange: MOE_FWD_INDEX_BYTES per copy
#   with checkpointing, half without where part of them is kept) and the router's c-byte logits, which the block
#   holds (`_, weights, index = self.gate(...)`).
# - backward: the un-permute's gradient — the [tokens, k, h] expanded output gradient, the zeros and the scattered
#   rows of the index backward (w·h each; c·h + 2·w·h measured) — or the up-projection's — the gradients of the
#   product, act(gate), and the concatenated c·2I gate/up gradient (c·4I). Without checkpointing it runs beside
#   every kept tensor, less two c-byte hidden-sized tensors of the head already freed (MOE_BWD_HEAD_FREED); with
#   checkpointing beside the recomputed layer, plus MOE_BWD_INDEX_BYTES per copy.
# Measured on the CPU, where transformers 5.24 runs the same `grouped_mm_experts_forward` (torch 2.13's
# F.grouped_mm) as on CUDA (sm80+); that the CUDA kernels return the same tensors is assumed, not measured here.
MOE_FWD_INDEX_BYTES = 48
MOE_FWD_BESIDE_CKPT, MOE_FWD_BESIDE_NO_CKPT = 2, 4
MOE_BWD_HEAD_FREED = 2
MOE_BWD_INDEX_BYTES = 32
# The up-projection's backward moment: with checkpointing the act·up product's gradient and the two gradients of its
# factors (c·3I per copy), the recomputed down output and routing weight already freed (w·h per copy): within
# +16..+144 B/token of the layers' backward window on four shapes (Mixtral- and Qwen3-MoE-like, I from 0.375·h to
# 4·h). Without checkpointing 4·c·I per copy (the concatenated c·2I gate/up gradient too) is an envelope: exact at
# I = 1.75·h (Mixtral-like), over by 5.1 and 10.3 KB/token at I = 4·h and 1.5·h with top-8 (+3.1 / +4.2 % of the
# layers' window; the planner checkpoints real MoE models, whose layers do not fit otherwise).
MOE_BWD_UP_I_CKPT, MOE_BWD_UP_I = 3, 4


def _moe_widths(arch: Architecture, s: Setup) -> tuple[int, int, int, int, int]:
    """(k, h, I, c, w) of the experts' terms."""
    moe = arch.moe
    assert moe is not None
    c = DTYPE_BYTES[s.compute_dtype]
    return moe.top_k, arch.hidden_size, moe.intermediate_size, c, (4 if moe.routing == "fp32_renorm" else c)


def moe_eval_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, the MoE block's tensors in flight without autograd (evaluation): the experts' forward moment as
    under checkpointing, where nothing is kept either (read from the same attribution; evaluation itself is not
    measured on MoE), plus the shared expert's dense MLP (Qwen2-MoE) whose output is alive beside it."""
    k, h, i, c, w = _moe_widths(arch, s)
    moment = max(k * c * (h + 4 * i), k * h * (2 * c + 2 * w)) + k * MOE_FWD_INDEX_BYTES + c * arch.moe.experts
    return moment + (3 * c * arch.moe.shared_intermediate + c * h if arch.moe.shared_intermediate else 0)


def moe_forward_transient_bytes(arch: Architecture, s: Setup) -> float:
    """The experts' forward moment beyond what the layers keep (see MOE_FWD_INDEX_BYTES)."""
    k, h, i, c, w = _moe_widths(arch, s)
    logits = c * arch.moe.experts
    if s.gradient_checkpointing:
        moment = max(k * c * (h + 4 * i), k * h * (2 * c + 2 * w)) + k * MOE_FWD_INDEX_BYTES
        beside = MOE_FWD_BESIDE_CKPT
    else:
        moment = max(k * h * (c + 2 * w), k * c * i) + k * MOE_FWD_INDEX_BYTES // 2
        beside = MOE_FWD_BESIDE_NO_CKPT
    beside += _moe_extra_beside(arch, s)
    return (moment + logits + beside * c * h + FWD_TOKEN_STATS_BYTES) * s.tokens


def _moe_extra_beside(arch: Architecture, s: Setup) -> int:
    """Hidden-sized tensors beside the experts' forward moments in some families under checkpointing
    (SHARED_BESIDE_H, GRANITE_BESIDE_H; without it the shared expert's output is among the kept tensors)."""
    if not s.gradient_checkpointing:
        return 0
    extra = SHARED_BESIDE_H if arch.moe and arch.moe.shared_intermediate else 0
    return extra + (GRANITE_BESIDE_H if arch.model_type == "granitemoe" else 0)


def unused_sliding_mask_bytes(arch: Architecture, s: Setup) -> float:
    """Qwen2-MoE's forward builds a sliding-window mask even when no layer uses it (modeling_qwen2_moe.py always
    calls `create_sliding_window_causal_mask`, and with `use_sliding_window` false the config's window is 0, which
    no sequence can skip): a bool b × s × s alive through the layers' forward, freed before the head (measured: the
    layers' forward window was s B/token short at 512 and 1,024 tokens, devkit/moe_check.py)."""
    if arch.model_type != "qwen2_moe" or arch.sliding_layers or s.attn_implementation != "sdpa":
        return 0.0
    return float(s.micro_batch_size * s.max_seq_len**2)


def moe_backward_transient_bytes(arch: Architecture, s: Setup) -> tuple[float, str]:
    """Gradients in flight at the experts' backward peak (see MOE_FWD_INDEX_BYTES): beside the recomputed layer with
    checkpointing; without, beside every kept tensor, or the final norm's fp32 backward when that is larger."""
    k, h, i, c, w = _moe_widths(arch, s)
    unpermute = k * h * (c + 2 * w)
    if s.gradient_checkpointing:
        grads = max(unpermute, k * (c * MOE_BWD_UP_I_CKPT * i - w * h)) + k * MOE_BWD_INDEX_BYTES
        grads += (GRANITE_BESIDE_H * c * h) if arch.model_type == "granitemoe" else 0
        return grads * s.tokens, "recomputed experts' gradients (measured)"
    grads = max(NORM_BWD_BYTES_PER_H * h, max(unpermute, MOE_BWD_UP_I * k * c * i) - MOE_BWD_HEAD_FREED * c * h)
    grads += SHARED_BESIDE_H * c * h if arch.moe.shared_intermediate else 0
    return grads * s.tokens, "experts' gradients or the final RMSNorm backward (measured)"


def layer_moments(arch: Architecture, est: Estimate) -> tuple[float, float]:
    """(forward, backward) live bytes at the decoder layers' own peaks, static included: the moments the estimate's
    forward and backward peaks take the larger of with the head's and the loss's (`_forward_backward`). For the
    harnesses that measure the layers' windows apart (devkit/moe_check.py)."""
    arch_s = est.setup
    c, t = DTYPE_BYTES[arch_s.compute_dtype], arch_s.tokens
    kept, layer = _activations(arch, arch_s, [])
    head = head_saved_bytes(arch, arch_s) * t
    rope = 2 * c * arch.head_dim * t
    layer_fwd = rope + max(forward_transient_bytes(arch, arch_s), masked_attention_forward_bytes(arch, arch_s))
    grads, _ = backward_transient_bytes(arch, arch_s)
    dequant = (
        c * max(lin.in_features * lin.out_features for lin in arch.linears) if arch_s.quantization != "none" else 0
    )
    layer_bwd = layer + grads + dequant if arch_s.gradient_checkpointing else grads
    static = est.phases["static"]
    return static + kept + layer_fwd, static + kept + head + layer_bwd
