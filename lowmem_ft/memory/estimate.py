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
from dataclasses import asdict, dataclass, field
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
# memory.chunked_loss (lowmem_ft/train/losses.py CHUNK_FP32_BYTES, chunk_tokens_for): a chunk holds at most 64 MiB
# of fp32 logits, i.e. 64 MiB / (4·V) tokens (110 at a 152k vocabulary). Its working set, measured with PeakMemory in
# scripts/bench_savers.py (fp32 compute, V 151,936, 2,047 tokens, benchmarks/savers_cpu.md): 0.185 GB = k·V·(c + 7)
# — the chunk's logits in the compute dtype, an fp32 copy and exp(), less than the 12 B/logit of the full loss
# because only per-token statistics outlive a chunk. bf16 compute is assumed to follow the same form (unmeasured).
CHUNK_FP32_BYTES = 64 * 2**20
CHUNK_BYTES_PER_LOGIT = 7
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
# computed once by the model's rotary embedding, saved by every layer's `q * cos`), int64 input ids, attention mask
# and the loss's targets (8 B each), fp32 log_z and entropy the fused head saves (4 B each). Measured remainder
# 23-35 B/token beyond RoPE (PeakMemory, the 1-layer model's forward minus one layer).
TOKEN_BOOKKEEPING_BYTES = 3 * 8 + 2 * 4
# Backward transients measured on the CPU with PeakMemory (the backbone alone with `last_hidden_state.sum()`; Qwen2-
# and Llama-shaped layers, h 512/384, i 1408/1024): without checkpointing the backward's first op, the final RMSNorm
# backward, holds ~5 fp32 hidden-sized gradients (20·h B/token: 10236 and 7676 measured vs 10240 and 7680); with
# checkpointing the recomputed layer's saved activations plus MLP/LoRA gradients in flight ≈ (8·i + 5·h) B/token
# (13676 and 10076 measured vs 13824 and 10112). Same eager ops on CUDA, so assumed to carry over.
NORM_BWD_BYTES_PER_H = 20
RECOMPUTE_BWD_I, RECOMPUTE_BWD_H = 8, 5
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
    activation_offloading: bool = False
    loss_impl: LossImpl = "trl_fused"
    loss_chunk_tokens: int | None = None  # memory.chunked_loss: tokens per chunk (None: as losses.py sizes them)
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
        if arch.qk_norm:
            out += [(arch.head_dim, c)] * (2 * arch.num_layers)
        out.append((arch.embedding_params, c))
        if arch.lm_head_params:
            out.append((arch.lm_head_params, c))
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
    n_lin = arch.num_layers * sum(lin.in_features * lin.out_features for lin in arch.linears)
    n_rest = arch.total_params - n_lin  # embeddings, lm_head (once if tied), norms, biases
    if s.quantization == "nf4":
        bits = NF4_DQ_BITS if s.double_quant else NF4_BITS
        state = arch.num_layers * len(arch.linears) * (NF4_DQ_STATE_BYTES if s.double_quant else NF4_STATE_BYTES)
        return n_lin * bits / 8 + state, n_rest * c, f"NF4 {bits:.3f} bit/param (bitsandbytes quantize_4bit, block 64)"
    if s.quantization == "int8":
        rows = arch.num_layers * sum(lin.out_features for lin in arch.linears)
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


def layer_activation_bytes(arch: Architecture, s: Setup) -> float:
    """Bytes one decoder layer keeps for backward per token, without checkpointing (autograd's saved tensors).

    Read from the modeling code (modeling_llama/qwen2 RMSNorm upcast, RoPE, MLP), torch's autograd formulas (a
    frozen weight makes its op keep no input) and peft lora/layer.py Linear.forward (input cast to fp32, dropout
    mask, lora_A input and output); checked against PeakMemory per layer (1- vs 2-layer models,
    benchmarks/estimator_cpu.md:
    exact for full fine-tuning and, with the CPU dropout mask, for LoRA/QLoRA).
    """
    c = DTYPE_BYTES[s.compute_dtype]
    h, i = arch.hidden_size, arch.intermediate_size
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    full = s.adapter == "full"
    # RMSNorm: hidden.to(float32) is kept (pow and mul both need it) + rsqrt per token; with a trainable weight the
    # normalized c-byte input of `weight *` is kept too.
    per_norm = 4 * h + 4 + (c * h if full else 0)
    total = arch.norms_per_layer * per_norm
    # Linears: a trainable weight keeps its input (c bytes); a frozen one keeps nothing. Inputs shared by several
    # linears (q/k/v, gate/up) are one tensor.
    if full:
        shared: dict[tuple[int, bool], int] = {}
        for lin in arch.linears:
            shared.setdefault((lin.in_features, lin.name in ("o_proj", "c_proj", "down_proj")), lin.in_features)
        total += c * sum(shared.values())
    else:
        # LoRA on a linear: x.to(fp32) → dropout keeps its mask (DROPOUT_MASK_BYTES) and lora_A keeps the fp32
        # dropped input (4 B) and lora_B keeps lora_A's output (4 B × r). Each adapted linear does this on its own.
        drop = DROPOUT_MASK_BYTES[s.device] if s.lora_dropout > 0 else 0
        for lin in lora_linears(arch, s):
            total += (4 + drop) * lin.in_features + 4 * s.lora_r
    # Attention (SDPA flash/efficient, or flash_attention_2): q, k, v, output (c bytes) + fp32 logsumexp per head.
    padded = s.micro_batch_size > 1 and s.attn_implementation == "sdpa"
    # With a padding mask (micro batch > 1) transformers repeats k/v to all heads (sdpa_attention.py repeat_kv,
    # `use_gqa_in_sdpa` needs mask None) and torch's SDPA converts the bool mask to a c-byte additive mask
    # (b × 1 × s × s) that each layer's attention keeps: s·c per token (measured 256 B/token at s 128, bf16).
    kv_kept = q if padded else kv
    total += c * (2 * q + 2 * kv_kept) + 4 * arch.num_heads
    if padded:
        total += c * s.max_seq_len
    # MLP: act(gate) keeps gate (c·i), the product keeps act(gate) and up (2·c·i).
    total += 3 * c * i if arch.mlp == "gated" else c * i
    return total


def first_layer_discount(arch: Architecture, s: Setup) -> float:
    """Per token, what the first layer does not keep when its input needs no gradient (LoRA without checkpointing:
    frozen embeddings, and `enable_input_require_grads` is only set for checkpointing): the input RMSNorm's fp32
    upcast and rsqrt, and the dropout masks of the attention input projections (`input * noise` keeps the noise
    only for an input that requires grad). Measured: 8203 B/token less for h 512 (= 4·512 + 4 + 3·4·512 + 7)."""
    if s.adapter == "full" or s.gradient_checkpointing:
        return 0.0
    h = arch.hidden_size
    drop = DROPOUT_MASK_BYTES[s.device] if s.lora_dropout > 0 else 0
    attn_in = sum(lin.in_features for lin in lora_linears(arch, s) if lin.name in ATTENTION_INPUT_LINEARS)
    return 4 * h + 4 + drop * attn_in


def head_saved_bytes(arch: Architecture, s: Setup) -> float:
    """Per token, kept from the end of forward to the loss's backward: the final RMSNorm (fp32 upcast, rsqrt, and
    its normalized input when trained), the loss input (the fused head's `hidden_states[:, :-1]` is reshaped — a
    c-byte copy — on the CPU, and gathered `hidden_states[mask]` on CUDA), RoPE cos/sin and bookkeeping."""
    c = DTYPE_BYTES[s.compute_dtype]
    h = arch.hidden_size
    norm = 4 * h + 4 + (c * h if s.adapter == "full" else 0)
    loss_input = c * h if s.loss_impl == "trl_fused" else 0
    return norm + loss_input + 2 * c * arch.head_dim + TOKEN_BOOKKEEPING_BYTES


def eager_scores_bytes(arch: Architecture, s: Setup) -> float:
    """Eager attention keeps softmax probabilities (and dropout-free: the matmul input) b·heads·s² in c bytes ×2."""
    c = DTYPE_BYTES[s.compute_dtype]
    return 2 * c * arch.num_heads * s.micro_batch_size * s.max_seq_len**2


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
        k = min(n, s.loss_chunk_tokens or max(1, CHUNK_FP32_BYTES // (4 * v)))
        b = k * v * (c + CHUNK_BYTES_PER_LOGIT) + 4 * n * h
        return b, b, f"one chunk of {k} tokens × vocab (lowmem_ft/train/losses.py), fp32 hidden gradient"
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
        bwd = acc + mm_buf + max(4 * CPU_TILE_FP32_BWD * tile, addmm, tail)
        where = "CPU torch fold: fp32 tile copies (3.25 fwd, 7.25 bwd)"
    else:
        fwd, bwd = mm_buf, acc + mm_buf + tail
        where = "Triton fold: no fp32 tile copies"
    return fwd, bwd, f"TRL fused LM head: {rows} × 32768 tile buffer, fp32 accumulators; {where}"


def estimate(arch: Architecture, s: Setup) -> Estimate:
    """Named components of the peak, and the peak itself (see the module docstring for how they combine)."""
    c = DTYPE_BYTES[s.compute_dtype]
    t = s.tokens
    comps: list[Component] = []
    notes: list[str] = []

    w_lin, w_rest, w_desc = weight_bytes(arch, s)
    comps.append(Component("base weights (linears)", w_lin, "static", w_desc))
    rest_what = "embeddings + lm_head" if not arch.tie_embeddings else "tied embeddings (once)"
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
    if paged:
        comps.append(Component("paged optimizer states", paged, "host", "bnb paged memory: evicted under pressure"))
        notes.append(f"{paged / GB:.2f} GB of optimizer state is paged (unified memory) and not counted in the peak")
    static = sum(x.bytes for x in comps if x.phase == "static")

    # forward/backward: what the forward keeps for backward (`kept`), then the largest transient on top of it
    layer = layer_activation_bytes(arch, s) * t
    if s.gradient_checkpointing:
        boundary = c * arch.hidden_size * t  # a decoder layer's input, what a checkpoint keeps
        kept = 0.0 if s.activation_offloading else arch.num_layers * boundary
        label = "checkpointed layer inputs" + (" (offloaded to host)" if s.activation_offloading else "")
        comps.append(Component(label, kept, "forward/backward", "non-reentrant checkpoint keeps each layer's input"))
        if s.activation_offloading:
            comps.append(Component("offloaded layer inputs", arch.num_layers * boundary, "host", "save_on_cpu"))
        comps.append(Component("one layer's activations (recompute)", layer, "forward/backward", "recomputed in bwd"))
    else:
        kept = arch.num_layers * layer - first_layer_discount(arch, s) * t
        comps.append(Component("activations, all layers", kept, "forward/backward", "autograd saved tensors"))
    if s.attn_implementation == "eager":
        eager = eager_scores_bytes(arch, s) * (1 if s.gradient_checkpointing else arch.num_layers)
        comps.append(Component("eager attention scores (s²)", eager, "forward/backward", "softmax probs kept"))
        if not s.gradient_checkpointing:
            kept += eager
        else:
            layer += eager
    head = head_saved_bytes(arch, s) * t
    comps.append(Component("final norm + loss input", head, "forward/backward", "RMSNorm upcast, head input, RoPE"))
    kept += head
    loss_fwd, loss_bwd, loss_src = loss_bytes(arch, s)
    comps.append(Component("logits / loss working set", max(loss_fwd, loss_bwd), "forward/backward", loss_src))
    h, i = arch.hidden_size, arch.intermediate_size
    if s.gradient_checkpointing:
        grads_in_flight = (RECOMPUTE_BWD_I * i + RECOMPUTE_BWD_H * h) * t
        layer_bwd = layer + grads_in_flight
        bwd_src = "recomputed layer's MLP/LoRA gradients (measured)"
    else:
        grads_in_flight = layer_bwd = NORM_BWD_BYTES_PER_H * h * t
        bwd_src = "final RMSNorm backward, fp32 (measured)"
    comps.append(Component("backward gradient buffers", grads_in_flight, "forward/backward", bwd_src))
    dequant = 0.0
    if s.quantization in ("nf4", "int8"):
        dequant = c * max(lin.in_features * lin.out_features for lin in arch.linears)
        comps.append(Component("dequantization buffer", dequant, "forward/backward", "largest linear in 16-bit"))
    # Full fine-tuning: the embedding's dense backward makes a new c-byte V × h gradient beside the accumulated one,
    # and the CPU measurement shows about two such buffers at the end of the backward (embedding_dense_backward).
    embed_bwd = 2 * c * arch.vocab_size * h if s.adapter == "full" else 0.0
    fwd_peak = kept + loss_fwd
    bwd_peak = max(kept + loss_bwd, kept + layer_bwd + dequant, embed_bwd + c * h * t)
    fwd_bwd = max(fwd_peak, bwd_peak)

    step_temp, step_src = optimizer_step_temp(trainable, s.optimizer, s.device, fp32_states)
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
    from dataclasses import replace

    train = estimate(arch, s)
    static = sum(x.bytes for x in train.components if x.phase == "static" and x.name != "gradients")
    es = replace(s, micro_batch_size=batch, gradient_checkpointing=False, activation_offloading=False, lora_dropout=0.0)
    c, t = DTYPE_BYTES[s.compute_dtype], es.tokens
    loss_fwd, _, _ = loss_bytes(arch, es)
    dequant = c * max(x.in_features * x.out_features for x in arch.linears) if s.quantization != "none" else 0.0
    # Without autograd nothing outlives its layer: the peak is one layer's tensors in flight (beside the dequantized
    # weight), or later the loss's forward beside the final norm and loss input — never both (measured with the
    # exact CPU count of real runs' evaluations, lowmem_ft.train.exact: summing them over-predicted by up to 25 %).
    layer = max(layer_activation_bytes(arch, es), eval_mlp_bytes(arch, es)) * t + 2 * c * arch.hidden_size * t
    transient = max(layer + dequant, head_saved_bytes(arch, es) * t + loss_fwd)
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
