"""The memory model's calibration table: every constant, what it was read from or measured with, and under which
library versions (pure data; no torch).

Each constant keeps the comment that derives it and is declared with its `Source` beside its value —
`NAME: Annotated[type, Source(kind, where)] = value` — saying its kind — `code` (read from the named library file
and function), `measured` (the named harness and benchmark table; exact live tensor bytes on the CPU with PeakMemory
or saved-tensor hooks unless said otherwise), `code+measured` (read, then confirmed by a measurement), `assumed`
(neither: a typical figure, to be replaced by the GPU harness's reading) — and where. `SOURCES` collects them by
name from the declarations. Every constant was read or measured with the libraries of `lowmem_ft.versions.CHECKED` installed
(`VERSIONS`); `doctor` and `plan` say when the installed ones differ. A prediction is not a measurement: the
benchmark tables under benchmarks/ say which of their numbers are which.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Literal, get_type_hints

from lowmem_ft.memory.records import GB
from lowmem_ft.versions import CHECKED

VERSIONS = CHECKED  # the library versions every constant below was read from or measured with


@dataclass(frozen=True)
class Source:
    kind: Literal["code", "measured", "code+measured", "assumed"]
    where: str  # the library file and function read, or the harness and benchmark table of the measurement


# where several constants come from
_BNB_OPT = "bitsandbytes optim/optimizer.py Optimizer2State.init_state / get_state_buffer"
_RECOMPUTE_END = (
    "torch utils/checkpoint.py (non-reentrant, early stop), peft lora/layer.py and bnb.py; "
    "lowmem_ft.train.trace.step at full size, models cut to one layer, live storages named by op"
)
_LONG = "devkit/harness/long_context.py (Llama/Qwen2/Mistral shapes), benchmarks/long_context_cpu.md"
_LAYERS = "devkit/harness/long_context.py layers' window, op attribution (42 setups), tests/memory/test_estimate.py"
_MOE = "devkit/harness/moe.py (one block and 1- vs 2-layer runs), benchmarks/estimator_moe.md"
_CHUNKED = "PeakMemory on lowmem_ft/train/losses.py token_log_probs alone, tests/memory/test_estimate_loss.py"
_GRPO = "PeakMemory around TRL's HF generate (zoo llama3 / qwen2.5), devkit/harness/grpo.py, benchmarks/grpo_cpu.md"
_EAGER_FWD = (
    "transformers modeling_gemma2.py eager_attention_forward, Gemma2DecoderLayer; traced at full size "
    "(lowmem_ft.train.trace.step, gemma-2-9b cut to one layer, peak located by stack)"
)
_EAGER_BWD = (
    "traced at full size (lowmem_ft.train.trace.step, gemma-2-9b cut to one layer, 1 x 2,048 / 4,096 / 8,192 tokens, "
    "live storages at the softmax backward named by op and stack)"
)


# bitsandbytes functional.quantize_4bit: blocksize 64, one fp32 absmax per block → 4 + 32/64 = 4.5 bits/param.
# With double quant (compress_statistics) the absmax are quantized to 8 bits in blocks of 256 with an fp32 absmax
# each → 4 + 8/64 + 32/(64·256) ≈ 4.127 bits/param.
NF4_BITS: Annotated[float, Source("code", "bitsandbytes functional.py quantize_4bit (blocksize 64, fp32 absmax)")] = 4.5
NF4_DQ_BITS: Annotated[float, Source("code", "bitsandbytes functional.py quantize_4bit, compress_statistics")] = (
    4 + 8 / 64 + 32 / (64 * 256)
)
# Beyond the per-parameter bits, each quantized linear's QuantState holds the NF4 code (16 fp32) and, with double
# quant, the absmax offset (one fp32) and the 8-bit code of the absmax quantization (256 fp32): 64 + 4 + 1024 B (read
# from a quantized Linear4bit's quant_state; found by the exact CPU measurement of real runs, lowmem_ft.train.measure.exact,
# as 1092 B of static memory per linear the estimate lacked).
NF4_STATE_BYTES: Annotated[
    int, Source("code+measured", "bitsandbytes Linear4bit quant_state; lowmem_ft.train.measure.exact runs")
] = 16 * 4
NF4_DQ_STATE_BYTES: Annotated[
    int, Source("code+measured", "bitsandbytes QuantState (nested); lowmem_ft.train.measure.exact runs")
] = 16 * 4 + 4 + 256 * 4
# bitsandbytes Linear8bitLt (LLM.int8): int8 weight + one fp32 scale (SCB) per output row.
INT8_ROW_SCALE_BYTES: Annotated[int, Source("code", "bitsandbytes nn/modules.py Linear8bitLt (SCB per output row)")] = 4
# bitsandbytes optim/optimizer.py Optimizer2State.init_state: 8-bit states are two uint8 tensors plus two fp32
# absmax per block of 256; tensors with fewer than `min_8bit_size` = 4096 elements keep fp32 states; paged buffers
# (get_state_buffer) are used only for tensors of ≥ 1e5 elements and only on CUDA.
BNB_BLOCK: Annotated[int, Source("code", _BNB_OPT)] = 256
BNB_MIN_8BIT_SIZE: Annotated[int, Source("code", _BNB_OPT)] = 4096
BNB_PAGED_MIN: Annotated[int, Source("code", _BNB_OPT)] = 100_000
# TRL 1.16 kernels/chunked_logprob.py: the fused LM head SFTTrainer installs (`add_fused_lm_head`) projects the
# hidden states in tiles of TOKEN_CHUNK_SIZE tokens × `_CHUNKED_LOGPROB_CHUNK_SIZE` vocabulary (trainer/utils.py).
# ChunkedLogProbFunction.forward/backward each allocate `mm_buf = empty((min(N, 4096), chunk_size))` in the compute
# dtype: its width is the full 32,768 even when the vocabulary is smaller (measured: 2.05 fp32 tiles of a
# 512 × 8000 tile = 512 × 32768 × 2 B).
TRL_TOKEN_CHUNK: Annotated[
    int, Source("code", "trl kernels/chunked_logprob.py, trainer/utils.py add_fused_lm_head")
] = 4096
TRL_VOCAB_CHUNK: Annotated[
    int, Source("code+measured", "trl kernels/chunked_logprob.py mm_buf; PeakMemory 512 × 8000 tile")
] = 32768
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
CPU_TILE_FP32_FWD: Annotated[
    float, Source("measured", "PeakMemory trace of trl ChunkedLogProbFunction (N 512, V 8000, bf16)")
] = 3.25
CPU_TILE_FP32_BWD: Annotated[
    float, Source("measured", "PeakMemory trace of trl ChunkedLogProbFunction (N 512, V 8000, bf16)")
] = 7.25
# The is_top1 share of the forward fold (`before_target`, 1 B per logit): GRPOTrainer installs the head with
# outputs=("log_probs", "entropy") (grpo_trainer.py `add_fused_lm_head`), so its fold peaks at 3.0 fp32 tiles —
# measured: TRL's GRPO forward (and its no-grad scoring passes) 1 B per logit under the SFT fold, 241,904 B of
# 253,952 at 124 × 2,048 logits (devkit/harness/grpo.py, zoo llama3 LoRA).
CPU_TILE_TOP1_FWD: Annotated[
    float,
    Source(
        "code+measured", "trl chunked_logprob.py _forward_tile; devkit/harness/grpo.py forward, benchmarks/grpo_cpu.md"
    ),
] = 0.25
# memory.chunked_loss (lowmem_ft/train/losses.py ChunkedLinearCrossEntropy): a chunk of k tokens; by default
# (no chunk size set) 64 MiB of fp32 logits, i.e. 64 MiB / (4·V) tokens (110 at a 152k vocabulary).
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
CHUNK_FP32_BYTES: Annotated[
    int, Source("code", "lowmem_ft/train/losses.py ChunkedLinearCrossEntropy (64 MiB of logits)")
] = 64 * 2**20
CHUNK_FWD_BYTES_PER_LOGIT: Annotated[int, Source("measured", _CHUNKED)] = 8
CHUNK_FWD_BYTES_PER_LOGIT_SOFTCAP_FP32: Annotated[int, Source("measured", _CHUNKED)] = 12
CHUNK_BWD_BYTES_PER_LOGIT: Annotated[int, Source("measured", _CHUNKED)] = 4
CHUNK_BWD_BYTES_PER_LOGIT_SOFTCAP: Annotated[int, Source("measured", _CHUNKED)] = 16
CHUNK_BWD_BYTES_PER_TOKEN: Annotated[int, Source("measured", "tiny-model run at 4,096 tokens (PeakMemory)")] = 3 * 4
CHUNKED_LABEL_BYTES: Annotated[int, Source("measured", _CHUNKED)] = 8 + 4
CHUNKED_POSITION_BYTES: Annotated[int, Source("measured", _CHUNKED)] = 2
# transformers loss/loss_utils.py ForCausalLMLoss as Trainer runs it. Its backward holds cross_entropy's saved fp32
# log_softmax, nll_loss's fp32 gradient and log_softmax's (4 B each), and not the c-byte logits: nothing saves them
# (`.float()`'s backward needs no input), and Trainer.compute_loss drops the model's outputs before `backward`, as
# the full-logits head `train` installs does (lowmem_ft/train/losses.py full_token_log_probs returns no logits). A
# loop that keeps the outputs through its backward holds c more per logit (PEFT's MetaMathQA run.py,
# docs/published-gpu-runs.md). Measured with PeakMemory, 512 rows × 8,000 vocab, bf16: 12.0 B per logit over the
# hidden state's bytes, 13.97 with the outputs kept, for the head and ForCausalLMLoss alike
# (tests/train/test_losses.py).
HF_LOSS_BYTES_PER_LOGIT: Annotated[int, Source("code+measured", "transformers loss/loss_utils.py ForCausalLMLoss")] = (
    4 + 4 + 4
)
# Its forward holds the c-byte logits, the fp32 upcast and the log_softmax (the gradients come in backward); this is
# the part beyond the logits. The full-logits head holds the same, its no-grad entropy blocks within the upcast it
# has freed; measured: tests/train/test_losses.py (PeakMemory, 512 rows × 8,000 vocab).
HF_LOSS_FORWARD_BYTES_PER_LOGIT: Annotated[int, Source("code", "transformers loss/loss_utils.py ForCausalLMLoss")] = (
    4 + 4
)
# TRL's experimental ORPO / CPO (SimPO) loss, outside the model's forward, on 16-bit logits: `selective_log_softmax`
# (trl/trainer/utils.py) takes its row-by-row path for bf16/fp16 — each row's log_softmax (c bytes) is saved, and the
# backward frees them row by row while the logits' gradient fills — so the backward window holds ~2 c-byte copies of
# the logits, not ForCausalLMLoss's fp32 working set. fp32 logits take its logsumexp path, which that working set
# with the logits kept matches (`concatenated_forward` keeps `outputs.logits`: c + 12; 16.9 / 14.9 B per logit
# measured, c = 4). ORPO's NLL over the chosen half
# (`cross_entropy_loss`: a contiguous copy and its log_softmax, c bytes each per chosen logit) adds ORPO_NLL_COPIES
# c-byte copies per logit of the whole batch: 1 with 16-bit logits (both alive at the peak), 0.5 in fp32 (the copy is
# freed first). Measured: benchmarks/estimator_preference.md (devkit/harness/preference.py, bf16 zoo models at the
# grid's width; SimPO Qwen2.5 LoRA 4 rows × 96: the backward 37.64 MB measured, 78.5 MB at c + 12 per logit).
ODDS_RATIO_16BIT_LOGIT_COPIES: Annotated[
    int, Source("code+measured", "trl utils.py selective_log_softmax; benchmarks/estimator_preference.md")
] = 2
# Final-logit softcapping (Gemma-2: modeling_gemma2.py `logits / cap`, `tanh`, `* cap`) on the full logits a model
# returns: tanh's output (c bytes per logit) is saved for its backward while the graph lives, one more c-byte copy
# in the forward and the backward windows. Measured: Gemma-2 ORPO full / SimPO QLoRA in the preference grid were
# 15 / 19 % over the model's forward before it (2.1 B per logit, c = 2).
SOFTCAP_LOGIT_COPIES: Annotated[
    int,
    Source(
        "code+measured", "transformers modeling_gemma2.py Gemma2ForCausalLM.forward; benchmarks/estimator_preference.md"
    ),
] = 1
# TRL's fused LM head computes the outputs its trainer asks for: SFTTrainer's and DPOTrainer's include `is_top1`
# (a bool tile per fold on the CPU, 1 B per tile element: 0.25 of CPU_TILE_FP32_FWD's fp32 copies), KTOTrainer's
# do not (kto_trainer.py: log_probs, entropy, mean_logits). Measured: the four KTO points of
# benchmarks/estimator_preference.md were 0.7-4.5 % over the forward before it (0.23-0.28 fp32 tile copies).
IS_TOP1_TILE_BYTES: Annotated[
    int,
    Source(
        "code+measured", "trl utils.py add_fused_lm_head outputs; kto_trainer.py; benchmarks/estimator_preference.md"
    ),
] = 1
ORPO_NLL_COPIES: Annotated[
    dict, Source("code+measured", "trl experimental/orpo concatenated_forward; benchmarks/estimator_preference.md")
] = {"16bit": 1.0, "float32": 0.5}
# ATen native/Dropout.cpp `is_fused_kernel_acceptable`: CUDA/XPU inputs take `native_dropout`, which saves a bool
# mask (1 B); other devices (the CPU) take the composite `_dropout_impl` (empty_like(input).bernoulli_() * input),
# which saves a noise tensor in the input's dtype — fp32 for peft's LoRA input. Measured on the CPU: a LoRA layer
# keeps 3 B/element more per adapted linear input than with a bool mask (PeakMemory, models built with 1 and 2
# layers, difference = one layer; benchmarks/estimator_cpu.md).
DROPOUT_MASK_BYTES: Annotated[dict, Source("code+measured", "ATen native/Dropout.cpp; benchmarks/estimator_cpu.md")] = {
    "cuda": 1,
    "cpu": 4,
}
# DoRA (peft 0.21 tuners/lora/dora.py DoraLinearLayer.forward, variants.py DoraLinearVariant.forward), per adapted
# linear, kept for backward: `(mag_norm_scale - 1) * base_result` keeps the base output (c B per output feature and
# token with dropout 0, where peft passes the base layer's result; fp32 = 4 B with dropout, where it recomputes
# F.linear on the fp32 dropped input), `mag_norm_scale * lora_result` keeps lora_B's fp32 output (4 B): together
# (c or 4) + 4 B per output feature and token. Per layer, independent of tokens: the magnitude / weight-norm
# division keeps the norm, the scale and the scale − 1 (3 fp32 per output feature). Measured with PeakMemory (zoo
# llama3, fp32, r 16, 7 targets, 2 layers, forward+backward at 512 and 1,024 tokens, DoRA minus LoRA): 10,240 B
# per token = 2 layers × 8 B × 640 output features, exactly; the fixed part 14,848 B against 2 × 12 × 640 = 15,360
# predicted (-3 %); dropout 0 and 0.05 gave the same bytes (fp32: base_result is 4 B either way).
DORA_KEPT_LORA_OUT_BYTES: Annotated[
    int, Source("code+measured", "peft tuners/lora/dora.py forward; PeakMemory zoo llama3")
] = 4
DORA_NORM_BYTES_PER_OUT: Annotated[
    int, Source("code+measured", "peft tuners/lora/dora.py forward; PeakMemory zoo llama3")
] = 3 * 4
# A decomposing adapter init (adapter.init pissa / olora; peft 0.21 tuners/lora/layer.py pissa_init, olora_init),
# per adapted linear: PiSSA's `weight - scaling * lora_B @ lora_A` holds the fp32 out × in product and the out × in
# result at once (2 copies); OLoRA subtracts the product in place (1, in lowmem_ft.memory.adapter_init). Measured
# with PeakMemory around peft's get_peft_model on zoo models (tests/train/test_adapter_init.py).
INIT_PRODUCT_COPIES: Annotated[
    int,
    Source(
        "code+measured",
        "peft tuners/lora/layer.py pissa_init / olora_init; "
        "PeakMemory around get_peft_model, tests/train/test_adapter_init.py",
    ),
] = 2
# On CUDA torch's linalg_svd / linalg_qr hand cuSOLVER a column-major clone of the input, which it overwrites
# (aten/src/ATen/native/BatchLinearAlgebra.cpp); invisible to the CPU count (made inside one kernel). Read from code.
INIT_SOLVER_INPUT_COPIES: Annotated[
    int, Source("code", "torch aten/src/ATen/native/BatchLinearAlgebra.cpp linalg_svd / qr")
] = 1
# Per-token tensors alive through forward and backward besides the layers: RoPE cos and sin (c × head_dim each,
# computed once by the model's rotary embedding, saved by every layer's `q * cos`), the loss's int64 shifted targets
# (8 B) and fp32 log_z and entropy the fused head saves (4 B each). Measured remainder 23-35 B/token beyond RoPE
# with one batch's tensors (PeakMemory, the 1-layer model's forward minus one layer).
TOKEN_BOOKKEEPING_BYTES: Annotated[int, Source("measured", "PeakMemory, 1-layer model's forward minus one layer")] = (
    8 + 2 * 4
)
# The batch's tensors, int64 (TRL DataCollatorForLanguageModeling: input_ids, labels and attention_mask, or
# position_ids when padding-free): 3 × 8 B per token. transformers' Trainer fetches a whole accumulation window's
# micro batches before the window's first forward (trainer.py get_batch_samples), each already on the device
# (accelerate DataLoaderShard.__iter__ sends a batch there before yielding it), and they stay referenced through the
# optimizer step; the loader also holds the next batch, on the host, to see the end of the data — device memory on
# the CPU only. Measured on the CPU (PeakMemory, a tiny-model run at 4,096 tokens, accumulation 1, optimizer step):
# six (1, 4096) int64 tensors from the collator's `torch.full`, 196.6 KB.
BATCH_BYTES_PER_TOKEN: Annotated[
    int,
    Source(
        "code+measured",
        "trl DataCollatorForLanguageModeling, transformers Trainer "
        "get_batch_samples; PeakMemory tiny-model run at 4,096 tokens",
    ),
] = 3 * 8
# Backward transients measured on the CPU with PeakMemory (the backbone alone with `last_hidden_state.sum()`; Qwen2-
# and Llama-shaped layers, h 512/384, i 1408/1024): without checkpointing the backward's first op, the final RMSNorm
# backward, holds ~5 fp32 hidden-sized gradients (20·h B/token: 10236 and 7676 measured vs 10240 and 7680); with
# checkpointing the recomputed layer's saved activations plus MLP/LoRA gradients in flight ≈ (8·i + 5·h) B/token
# (13676 and 10076 measured vs 13824 and 10112). Same eager ops on CUDA, so assumed to carry over.
NORM_BWD_BYTES_PER_H: Annotated[
    int, Source("measured", "PeakMemory, backbone backward (Qwen2/Llama shapes), estimator_cpu.md")
] = 20
RECOMPUTE_BWD_I: Annotated[
    int, Source("measured", "PeakMemory, backbone backward (Qwen2/Llama shapes), estimator_cpu.md")
] = 8
RECOMPUTE_BWD_H: Annotated[
    int, Source("measured", "PeakMemory, backbone backward (Qwen2/Llama shapes), estimator_cpu.md")
] = 5
# With peft's own LoRA branches (no DoRA, LoRA recompute or tiled MLP) the checkpointed backward's layer moment is
# the end of the recomputed forward (`lowmem_ft.memory.recompute`), not the 8·i + 5·h above, which was fitted on the
# backbone alone (no head: its sum()'s gradient) and, added to a full step's head, over-predicted every full-size
# checkpointed row (+0.4 to +3.6 %). Read from torch/utils/checkpoint.py (non-reentrant, early stop: the recompute
# ends when the last saved tensor exists, down_proj's lora_A output), peft lora/layer.py and bnb.py
# (`_cast_input_dtype`, result + lora_B(...) * scaling, cast back) and the autograd graph they build; traced
# (`lowmem_ft.train.trace.step`, models cut to one layer, each live storage at the backward's peak named by the op and
# stack that made it): beside the layer's saved tensors, down_proj's c-byte input and fp32 cast (RECOMPUTE_END_FP32
# bytes, unkept with dropout), RECOMPUTE_END_BESIDE c-byte hidden-sized tensors (the base output, the MLP's input,
# the residual sum), the layer output's c-byte gradient, the scaled fp32 gradient of lora_B's output
# (RECOMPUTE_END_GRAD_FP32) and, with an unquantized base, the base output's gradient in c bytes; the head's final
# norm and loss input freed. The moment's own bytes are within 24-32 B/token of the traced ones (the loader's next
# batch); the backward phase predicted +0.04 to +0.05 % (+357 to +459 B/token, the static part's terms) on
# Llama-3.1-8B (4 x 2,048 LoRA; 1 x 16,384 NF4) and Qwen2.5-14B (4 x 2,048 NF4), where 8·i + 5·h and the head
# over-predicted by 16.8, 32.1 and 40.3 kB/token, and on a Llama shape of h 512 / i 1,408 (4 x 2,048 LoRA; 1.7).
RECOMPUTE_END_FP32: Annotated[int, Source("code+measured", _RECOMPUTE_END)] = 4
RECOMPUTE_END_BESIDE: Annotated[int, Source("code+measured", _RECOMPUTE_END)] = 3
RECOMPUTE_END_GRAD_FP32: Annotated[int, Source("code+measured", _RECOMPUTE_END)] = 4
# The tiled MLP with checkpointing (devkit/harness/long_context.py, PeakMemory; fitted on a Llama-shaped h 128 /
# i 512 model at 1-2k tokens, checked on Qwen2- and Mistral-shaped ones at 1-8k, benchmarks/long_context_cpu.md):
# outside the MLP the recomputed layer's backward holds ~14·h B/token of gradients in flight (8·i + 5·h untiled:
# the MLP's share is gone); the MLP's backward runs one tile at a time — the tile's recomputed MLP tensors plus
# TILE_BWD_I·i B per tile token of gradients — beside the tiles' input gradients gathered for the split (c·h per
# token). The larger of the two is the term.
TILED_RECOMPUTE_BWD_H: Annotated[int, Source("measured", _LONG)] = 14
TILE_BWD_I: Annotated[int, Source("measured", _LONG)] = 6
# LoRA recompute without the tiled MLP: the recomputed MLP's gradients in flight are ~7·i + 5·h B/token (measured
# as above: 3,646 and 3,614 B/token at 1k and 2k tokens for i 512, h 128); 6·i + 5·h is within 3 %, on the safe side.
RECOMPUTE_BWD_I_LORA_RECOMPUTED: Annotated[int, Source("measured", _LONG)] = 6
# Tiled norms (same yardstick, tiles of 16 and 128 tokens): the RMSNorms' fp32 backward was most of the 14·h
# above; with them tiled the layer's backward holds ~4·h B/token in flight (514 measured for h 128), and one MLP
# tile ~8·i B per tile token beside its recomputed tensors (13.6 KB measured vs 13.4 KB) with no per-token gather in
# the peak; without checkpointing the final norm's fp32 backward (NORM_BWD_BYTES_PER_H) is per tile too.
TILED_NORMS_RECOMPUTE_BWD_H: Annotated[int, Source("measured", _LONG)] = 4
TILE_BWD_I_TILED_NORMS: Annotated[int, Source("measured", _LONG)] = 8
# That 4·h was measured with LoRA recompute on. With tiled MLP and norms but peft's own LoRA branches, the recomputed
# attention's LoRA backward holds more fp32 in flight: 10.1·h B/token (PeakMemory at 2,048 tokens, tiles of 64, the
# long-context yardstick's Llama, Qwen2 and Mistral shapes: 10.10, 10.06, 10.11; the 4·h under-predicted those peaks
# by 7.6-8.3 %); 10.5 keeps it on the safe side.
TILED_NORMS_BWD_H: Annotated[float, Source("measured", _LONG)] = 10.5
# The largest transient of one layer's forward (LoRA), beyond what the layers keep for backward and RoPE's cos/sin:
# measured at the layers' own peak (PeakMemory's window peak read by a forward pre-hook on the final norm, so the
# head's tensors, which do not exist yet, are not in it) and attributed op by op (a PeakMemory subclass recording
# each live storage's creating op and shape at the peak); Llama- (h 128, i 512, GQA 4/2), Qwen2- (h 96, i 448,
# GQA 6/2) and Mistral-shaped (h 160, i 384, MHA) models of devkit/harness/long_context.py at 2,048 tokens, LoRA r 8,
# every combination of the tiled MLP, tiled norms and LoRA recompute, with and without checkpointing (14 setups per
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
FWD_TRANSIENT_CKPT: Annotated[int, Source("measured", _LAYERS)] = 8
FWD_TRANSIENT_NO_CKPT: Annotated[int, Source("measured", _LAYERS)] = 4
FWD_OUTPUT_FP32: Annotated[int, Source("measured", _LAYERS)] = 8
FWD_BESIDE_CKPT: Annotated[int, Source("measured", _LAYERS)] = 3
FWD_BESIDE_NO_CKPT: Annotated[int, Source("measured", _LAYERS)] = 4
FWD_BESIDE_NO_CKPT_TILED_NORMS: Annotated[int, Source("measured", _LAYERS)] = 2
# Under checkpointing an adapted linear whose output is wide can peak on its output side rather than at the widest
# input (`transients.lora_output_side_bytes`): the base output, lora_B's fp32 output and its scaled copy
# (c + FWD_OUTPUT_FP32 per output element) beside its input and the input's fp32 cast (c + FWD_INPUT_CAST_FP32 per
# input element; in the checkpoint's no-grad forward the dropout noise and the dropped copy are freed once lora_A has
# read them, so the dropout adds nothing here) and what the block holds then (the residual sum in the MLP, the
# outputs of the projections computed before it). peft 0.21 lora/layer.py Linear.forward: `result =
# self.base_layer(x)`, `x = self._cast_input_dtype(x, ...)`, `result + lora_B(lora_A(dropout(x))) * scaling`.
# Traced at full size (`lowmem_ft.train.trace.step`, the model cut to one layer, each live storage at the peak named by
# the op and stack that made it): Phi-3-mini-4k's fused gate_up_proj (2·i from h; LoRA r 16, dropout 0.05, bf16,
# 4 x 4,096 tokens) holds 65,536 + 65,536 (lora_B's output, scaled) + 32,768 (base output) + 12,288 (the cast) +
# 2 x 6,144 (its input, the residual sum) = 188,416 B/token beside the checkpointed input: the layer's forward
# 3,891.6 MB predicted against 3,885.6 traced (3,082.5 with the widest input's moment alone). Llama-3.2-1B with
# dropout 0 (2,048 tokens): up_proj's output side beside act(gate), 898.3 MB predicted against 898.0 traced for the
# layer's forward window (864.7 before: the widest input's form counts a dropped copy dropout 0 does not make).
# On CUDA (1-byte dropout masks) up_proj's output side is the larger moment of a gated MLP too (12·i + 8·h B/token
# at c = 2, against 11·i + 6·h at down_proj's input): the same tensors, with the mask width read from ATen's
# native_dropout, not measured on a GPU.
FWD_INPUT_CAST_FP32: Annotated[
    int,
    Source(
        "code+measured",
        "peft lora/layer.py Linear.forward; full-size trace of "
        "Phi-3-mini-4k cut to one layer, located by stack (devkit/bench/real_size.py notes)",
    ),
] = 4
# With the tiled MLP under checkpointing the peak moves to the attention's output projection: q, k, v and the attention
# output (c each), the layer input's norm output and the projection's base output (c·h each) beside its LoRA copies
# (peft: mask + 8 per input element; LoRA recompute: 8 per output element, the fp32 tile outputs and their
# concatenation). Measured as above: 2,816 / 3,840 / 2,048 B/token (Llama / Mistral / Qwen2 shape, peft LoRA) and
# 2,304 / 3,200 / 1,664 (LoRA recompute), each +8.
# Two fp32 per-token statistics in flight at every layer moment (the RMSNorm's mean and rsqrt): the +8 B/token above.
FWD_TOKEN_STATS_BYTES: Annotated[int, Source("measured", _LAYERS)] = 2 * 4
# Eager attention's forward moments with checkpointing (the layer's forward runs without keeping anything, like an
# evaluation's). Read in transformers' modeling_gemma2.py (the other families' eager decoder layers are the same):
# `softmax(attn_weights, dtype=float32).to(query.dtype)` holds the c-byte masked scores, their fp32 upcast and the
# fp32 output at once (EAGER_SOFTMAX_FP32 fp32 copies per score; an fp32 input is its own upcast), beside q, k and v
# repeated to every head, k and v themselves and the layer's normed input; and the decoder layer's
# `hidden_states, _ = self.self_attn(...)` keeps the c-byte probabilities (`_`) alive until the layer returns, so
# they sit beside the MLP's LoRA moment too. Traced at full size (`lowmem_ft.train.trace.step`, gemma-2-9b cut to one
# layer, its 24 GB plan: LoRA+NF4, bf16, checkpointing; the peak located by stack): at 4 x 2,048 the peak is the
# softmax — 2 x 1,073.7 MB fp32 + 536.9 MB bf16 scores, 3 x 67.1 MB (q, k and v repeated) + 4 x 33.6 (k, v, ...)
# + 2 x 58.7 (layer input, normed input) — and at 4 x 1,024 it is the MLP's LoRA moment with the 134.2 MB of
# bf16 probabilities beside it (1,091.7 MB above static traced, 1,086 predicted).
EAGER_SOFTMAX_FP32: Annotated[int, Source("code+measured", _EAGER_FWD)] = 2
EAGER_SOFTMAX_BESIDE_Q: Annotated[int, Source("code+measured", _EAGER_FWD)] = 4
EAGER_SOFTMAX_BESIDE_KV: Annotated[int, Source("code+measured", _EAGER_FWD)] = 2
# The recomputed eager layer's backward peaks at its softmax backward once the scores outweigh the MLP's tensors
# (`activations.eager_softmax_backward_bytes`): `_softmax_backward_data` holds the saved fp32 output, the incoming
# gradient's fp32 upcast (`.to(query.dtype)`'s backward) and its fp32 result, 3 x 4 B per score, beside tanh's saved
# c-byte output (softcapping); the value matmul's saved probabilities and their c-byte gradient are freed by then.
# Traced at full size (gemma-2-9b cut to one layer, its long 24 GB plan: LoRA+NF4, bf16, checkpointing, 1 x 2,048 /
# 4,096 / 8,192 tokens, each live storage named by the op and stack that made it): 14 B per score, 2 B per
# position² (the bf16 additive mask, one per kind of layer: two in the whole model) and 140,534 B/token (the
# layer's input, the input norm's fp32 upcast, q/k/v's LoRA copies, q and k, v repeated, the residual's gradient,
# RoPE's cos/sin), exactly as at each length; the memory model had 8 B per score there and the MLP's tensors.
EAGER_SOFTMAX_BWD_FP32: Annotated[
    int, Source("code+measured", "torch autograd softmax / _to_copy backward; " + _EAGER_BWD)
] = 3
# Cohere's LayerNorm (modeling_cohere.py / _cohere2.py CohereLayerNorm, q/k norms included) is mean-centred and
# composite in fp32: `(x - mean).pow(2)` keeps its fp32 input and `(x - mean) * rsqrt(...)` a second fp32 x − mean of
# its own, one fp32 copy per element more than an RMSNorm, whose pow and mul share the upcast. Measured with
# autograd's saved-tensor hooks (every saved storage counted once, per module) on a Cohere h 256 / 3-layer model
# with q/k norms, bf16, 256 tokens: input_layernorm keeps 2 × 1,024 + 4 B/token (LoRA; + 1,024 for the normalized
# input under a full fine-tune), q_norm 2 × 1,024 + 16, k_norm 2 × 512 + 8; PeakMemory per layer agrees
# (tests/memory/test_estimate.py, Cohere and Apertus layer bytes), and so do the --blocks grid's peaks, within 0.1 %
# (python -m devkit.bench.estimator --blocks, benchmarks/estimator_blocks.md).
CENTRED_NORM_EXTRA_FP32: Annotated[
    int,
    Source(
        "code+measured",
        "transformers modeling_cohere.py CohereLayerNorm; "
        "python -m devkit.bench.estimator --blocks, benchmarks/estimator_blocks.md",
    ),
] = 4
# xIELU (transformers activations.py XIELUActivation._xielu_python, the path without the optional `xielu` CUDA
# package): `alpha_p * x * x` keeps x and alpha_p·x, `expm1(min(x, eps))` its output, `torch.where` its bool
# condition, and with trainable alpha_n `(expm1(...) - x) * alpha_n` keeps the difference. Measured as above on an
# Apertus h 256 / i 704 model: 3 × 1,408 + 704 B/token (LoRA: frozen alphas), 4 × 1,408 + 704 (full), against the
# c·i a plain activation keeps: (2·c + 1)·i more, and c·i more again when the alphas train (the same test and grid).
XIELU_KEPT_C: Annotated[
    int, Source("code+measured", "transformers activations.py XIELUActivation; estimator_blocks.md")
] = 2
XIELU_KEPT_C_TRAINED: Annotated[
    int, Source("code+measured", "transformers activations.py XIELUActivation; estimator_blocks.md")
] = 1
XIELU_KEPT_BOOL: Annotated[
    int, Source("code+measured", "transformers activations.py XIELUActivation; estimator_blocks.md")
] = 1
# Device overheads (CUDA only). Assumed, not measured in this session (no GPU): the GPU run of the harness
# measures NVML device use minus torch's reserved bytes.
CUDA_CONTEXT_BYTES: Annotated[
    float, Source("assumed", "typical nvidia-smi reading of a torch 2.x + CUDA 12 context")
] = 0.5 * GB
# torch aten/src/ATen/cuda/CublasHandlePool.cpp getChosenWorkspaceSize: 32 MiB per handle on Hopper (4 MiB before),
# plus the cuBLASLt workspace of the same size.
CUBLAS_WORKSPACE_BYTES: Annotated[
    int, Source("code", "torch aten/src/ATen/cuda/CublasHandlePool.cpp getChosenWorkspaceSize")
] = 2 * 32 * 2**20
# Caching allocator (CUDA): what it reserves over the live tensors of a training step, per setting (`Setup.allocator`,
# `lowmem_ft.cuda_alloc`: expandable segments unless the user set PYTORCH_CUDA_ALLOC_CONF) and kind of training.
# ALLOCATOR_PAGE_BYTES, the least any step holds unused: expandable segments map 2 MiB pages for the small pool and
# 20 MiB for the large (kSmallBuffer, kLargeBuffer); with the default settings a small request opens a 2 MiB segment
# and a 1–10 MiB one a 20 MiB segment.
# Expandable segments (what `train` sets), adapters: a base + a fraction of the churn (the step's transient peak
# plus the gradients, which the Trainer frees after every optimizer step), the upper envelope of replays of traced
# training steps through `lowmem_ft.train.measure.allocator` (torch 2.13's allocator read from
# CUDACachingAllocator.cpp): the fraction the largest (reserved − live − pages) / churn of the whole real-size adapter
# steps (Qwen2.5-0.5B, Llama-3.2-1B, Llama-3.1-8B, gemma-3-1b, Phi-3-mini, Mistral-7B, Qwen3-8B; LoRA, QLoRA; with and
# without checkpointing), 0.2 to 3.7 % (largest: Qwen2.5-0.5B QLoRA 4 × 1,024), so 3.8 %; the base the largest
# excess beyond it, 40 whole zoo steps (8 families at the grid's width) included.
# Expandable segments, full fine-tunes: blocks of the embedding gradient's size. Instrumented, the replays' excess at
# the reserved peak is two free blocks of exactly the tied embedding's gradient (V × h, bf16: 501/502 MiB
# Llama-3.2-1B, 576 gemma-3-1b, 445/447 Qwen2.5-1.5B): the head's and the embedding's gradients of a tied weight are
# summed, each freed block stays where the next step's smaller requests cannot fill it and the growing end cannot
# take it back. (reserved − live − pages) / that block: 2.00, 2.01, 1.98 (Qwen2.5-0.5B, also tied: 0.03), so
# 2.02 blocks; untied models have no such block: what is left is a share of the churn, the largest (excess − pages −
# blocks) / churn of the whole real-size full steps (Phi-3-mini, untied, 2 × 1,024 with checkpointing: 41 MiB of a
# 10.6 GB churn, 0.18 %), so 0.2 %, and the base the largest excess beyond both (the zoo's qwen3: 27 MiB).
# `python -m devkit.bench.allocator_term`, benchmarks/allocator_term.md (tests/memory/test_overheads.py checks these
# are what it derives). Replays of CPU-path logs, not GPU measurements; a GPU run's calibration
# (`lowmem_ft.calibrated`) adds what a GPU measures beyond them.
_ALLOC_TERM = "python -m devkit.bench.allocator_term, benchmarks/allocator_term.md"
ALLOCATOR_PAGE_BYTES: Annotated[
    int, Source("code", "torch c10/cuda/CUDACachingAllocator.cpp kSmallBuffer + kLargeBuffer")
] = (2 + 20) << 20
ALLOCATOR_FRACTION_EXPANDABLE: Annotated[float, Source("code+measured", _ALLOC_TERM)] = 0.038
ALLOCATOR_BASE_EXPANDABLE: Annotated[int, Source("code+measured", _ALLOC_TERM)] = 34 << 20
ALLOCATOR_TIED_GRAD_BLOCKS_EXPANDABLE: Annotated[float, Source("code+measured", _ALLOC_TERM)] = 2.02
ALLOCATOR_FRACTION_EXPANDABLE_FULL: Annotated[float, Source("code+measured", _ALLOC_TERM)] = 0.002
ALLOCATOR_BASE_EXPANDABLE_FULL: Annotated[int, Source("code+measured", _ALLOC_TERM)] = 27 << 20
# Expandable segments, adapters with the full-logits loss (`memory.full_logits_loss`, loss_impl "hf_full"): blocks of
# the step's fp32 logits (4 × rows × tokens × vocab). Instrumented, the excess is the hole its c-byte logits leave
# when the loss's forward returns: the backward's fp32 gradients, twice their size, cannot fill it, and the segment
# grows past it. (reserved − live − pages) / the fp32 logits of the real-size adapter steps with that loss traced
# whole (Qwen2.5-0.5B, Llama-3.2-1B, gemma-3-1b, Phi-3-mini QLoRA, Qwen3-8B; with the accumulating step and with one
# micro batch per optimizer step): 0.51 (gemma-3-1b, 262k vocabulary) to 0.95 (Phi-3-mini QLoRA, one micro batch),
# so 0.96 blocks, no share of the churn left, the base the pages. The fused-head steps' term above (derived without
# these rows) left them 0.4 to 1.5 c-byte logits short; it stays the floor (`overheads.allocator_terms`). A full
# fine-tune with that loss keeps its own term: it leaves Qwen2.5-1.5B's such step 0.37 GB short and Llama-3.2-1B's
# 0.21 GB (one micro batch; the accumulating step +0.02), and lowmem-ft's own step at PEFT's Llama-3.2-3B full
# fine-tune 0.7 GB over (benchmarks/published.md); no single count of logit blocks holds beside the tied gradient's,
# so none is added.
ALLOCATOR_LOGIT_BLOCKS_EXPANDABLE: Annotated[float, Source("code+measured", _ALLOC_TERM)] = 0.96
ALLOCATOR_BASE_EXPANDABLE_LOGITS: Annotated[int, Source("code+measured", _ALLOC_TERM)] = 22 << 20
# torch's default settings: kept as assumed, 10 % of the transient peak; no derived form holds. As a share of the
# churn the whole real-size steps' (reserved − live − pages) spreads from 0.7 to 31.5 % for adapters and 27 to 45 %
# for full fine-tunes. By blocks: instrumented, the reserved peak is always set by the step's largest tensor
# (`loss.largest_step_block`: TRL's fused-head tile or fp32 accumulator on the traced CPU path) asking for a new
# segment while the cached free blocks — pieces of earlier segments of that size, of the embedding gradient's, of
# the MLP's — are each too small for it; but how many of them are stranded is not a constant: 0.28 to 3.46 blocks
# for adapters (Llama-3.2-1B LoRA; Qwen3-8B LoRA with checkpointing), 1.71 to 3.28 for full fine-tunes
# (Llama-3.2-1B; Qwen2.5-1.5B). That envelope (3.47 / 3.29 blocks of the fp32 logits) puts the memory model 16 to
# 19 % over PEFT's published adapter runs and 3.7 to 8.3 % over its full fine-tunes (the held-out test,
# benchmarks/published.md, at 704 tokens); the assumed 10 % is +2.3 to +4.5 % and −4.4 to −0.2 % there.
ALLOCATOR_FRACTION: Annotated[
    float, Source("assumed", "typical reserved / allocated ratios of 1.05-1.15 in training; " + _ALLOC_TERM)
] = 0.10

# -- mixtures of experts (`lowmem_ft.memory.experts`; the shapes: lowmem_ft/memory/arch.py `MoE`) ----------------------------------------------------------
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
# 2-layer models, devkit/harness/moe.py).
MOE_INDEX_BYTES: Annotated[
    int, Source("code+measured", "transformers integrations/moe.py grouped_mm_experts_forward; " + _MOE)
] = 3 * 8
# Qwen2-MoE's shared expert (modeling_qwen2_moe.py: `sigmoid(shared_expert_gate(x)) * shared_expert(x)`): beside
# its dense MLP's terms the product keeps the shared expert's c-byte output and the c-byte sigmoid (per token), and
# that output is alive through the routed experts' moments (SHARED_BESIDE_H); Granite-MoE (`inputs_embeds *
# embedding_multiplier`) holds the unscaled embeddings beside the scaled first-layer input through the forward,
# and one more hidden-sized tensor is in flight in the recomputed layer's backward (GRANITE_BESIDE_H). Measured on
# the layers' windows (devkit/harness/moe.py): −2,013 / −993 B/token (Qwen2-MoE without / with checkpointing) and
# −481 / −496 (Granite-MoE, checkpointing) before these terms.
SHARED_GATE_KEPT_H: Annotated[int, Source("measured", _MOE)] = 1
SHARED_BESIDE_H: Annotated[int, Source("measured", _MOE)] = 1
GRANITE_BESIDE_H: Annotated[int, Source("measured", _MOE)] = 1
# The experts' transient moments (integrations/moe.py `grouped_mm_experts_forward`; k routed copies per token, w the
# routing weight's bytes: 4 for Mixtral's fp32 weights, else c), per token, attributed op by op with a PeakMemory
# subclass on one block (devkit/harness/moe.py shapes) and checked on whole runs' layer windows:
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
MOE_FWD_INDEX_BYTES: Annotated[int, Source("measured", _MOE)] = 48
MOE_FWD_BESIDE_CKPT: Annotated[int, Source("measured", _MOE)] = 2
MOE_FWD_BESIDE_NO_CKPT: Annotated[int, Source("measured", _MOE)] = 4
MOE_BWD_HEAD_FREED: Annotated[int, Source("measured", _MOE)] = 2
MOE_BWD_INDEX_BYTES: Annotated[int, Source("measured", _MOE)] = 32
# The up-projection's backward moment: with checkpointing the act·up product's gradient and the two gradients of its
# factors (c·3I per copy), the recomputed down output and routing weight already freed (w·h per copy): within
# +16..+144 B/token of the layers' backward window on four shapes (Mixtral- and Qwen3-MoE-like, I from 0.375·h to
# 4·h). Without checkpointing 4·c·I per copy (the concatenated c·2I gate/up gradient too) is an envelope: exact at
# I = 1.75·h (Mixtral-like), over by 5.1 and 10.3 KB/token at I = 4·h and 1.5·h with top-8 (+3.1 / +4.2 % of the
# layers' window; the planner checkpoints real MoE models, whose layers do not fit otherwise).
MOE_BWD_UP_I_CKPT: Annotated[int, Source("measured", _MOE)] = 3
MOE_BWD_UP_I: Annotated[int, Source("measured", _MOE)] = 4

# GRPO (TRL 1.16 GRPOTrainer, lowmem_ft.memory.grpo). Generation on TRL's HF path (`_generate_single_turn` →
# `generate`), measured with PeakMemory around `generate` on zoo llama3 and qwen2.5 (h 64, i 192, V 2,048 / 2,688,
# bf16 weights, LoRA fp32 or full), TRL's sampling settings (temperature 1, top_p 1, top_k 0), rows R and prompt P /
# completion C varied one at a time (devkit/harness/grpo.py; the numbers in benchmarks/grpo_cpu.md):
# - ids and attention mask, int64, grown by one column per new token: 2 × 8 B per row-token; with the KV cache
#   (bf16: 256 B per row-token on these models) the decode peak grows by exactly 272 B per row per completion token.
GRPO_IDS_BYTES_PER_TOKEN: Annotated[int, Source("code+measured", _GRPO)] = 2 * 8
# - TRL's own prompt tensors, alive around the `generate` call (`_generate_single_turn`, HF path): one int64 tensor
#   per prompt and its `ones_like`, then the left-padded ids and attention mask, int64, per row-token of the
#   prompts: 4 × 8 B. The prefill runs on the padded ones (no copy); the decode's grown ids and mask are beside them.
#   (The constants above were fitted around `generate` alone, where these were already alive.)
GRPO_PROMPT_BYTES_PER_TOKEN: Annotated[
    int, Source("code", "trl grpo_trainer.py _generate_single_turn (regular generation path)")
] = 4 * 8
# - sampling, per row: the c-byte logits of the last position (logits_to_keep=1) and six fp32 vocabulary-sized
#   tensors (the fp32 copy, the logits processors' outputs — min_new_tokens' among them —, softmax, multinomial's
#   working copy): R 8 → 16 adds 53,560 B per row at V 2,048 and 70,200 at V 2,688 beyond KV and ids = 26.1 B per
#   vocabulary entry = c + 6 × 4. Beside them two fp32 vocabulary vectors not per row (the fixed remainder,
#   20,964 / 26,716 B at V 2,048 / 2,688, of which ~2.5 kB is the one-token decode step).
GRPO_SAMPLING_FP32_PER_VOCAB: Annotated[int, Source("measured", _GRPO)] = 6
GRPO_SAMPLING_FP32_VOCAB_FIXED: Annotated[int, Source("measured", _GRPO)] = 2
# - the prefill (R × P tokens through the layers, one at a time, no autograd) peaks in a gated MLP: gate and up
#   outputs, act(gate) and the product (4·c·i; a LoRA gate/up adds its fp32 lora_B output and scaled copy,
#   `evaluation.eval_mlp_bytes`' 8·i, and peft's fp32 cast of the layer input, 4·h), beside the residual, the
#   normed input and the attention output (3·c·h) and RoPE's cos/sin (2·c·head_dim). Predicted 1,984 / 3,392 B per
#   prompt token (full / LoRA) against 2,000 / 3,408 measured (P 48 → 96, 8 rows; both families).
GRPO_PREFILL_HIDDEN: Annotated[int, Source("code+measured", _GRPO)] = 3
# - with eager attention (Gemma-2) the prefill's peak moves to the attention once the prompts are long: one fp32
#   score tensor (R × heads × P²) beside the layer's other tensors, which hold one c·h per token fewer than the MLP
#   moment. Measured with PeakMemory on a no-grad forward of zoo Gemma-2 LoRA (8 rows, P 8 / 16 / 32 / 64):
#   exactly 3,481·R·P + 16·R·P² B at P 32 and 64 (16 = 4 heads × 4 B; 3,481 = the MLP moment's 3,609 − c·h), the
#   MLP moment below P 16.
GRPO_EAGER_PREFILL_SCORES: Annotated[
    int, Source("measured", "PeakMemory, no-grad forward of zoo Gemma-2 LoRA, P 8..64; " + _GRPO)
] = 1
# The round's buffered inputs (`_generate_and_score_completions` → `_buffered_inputs`): prompt ids and mask over the
# prompt's tokens, completion ids and mask over the completion's, int64: 2 × 8 B per row-token (the shuffle's
# permuted copies, split into views, `shuffle_sequence_dict` / `split_tensor_dict`). `_prepare_inputs` replaces the
# buffer only once the next round is made, so the previous round's is alive through the next generation and scoring
# (measured: the second round's generation 4,136 B above the first's on zoo llama3, R 8 × 32 tokens + advantages).
GRPO_ROUND_BYTES_PER_TOKEN: Annotated[int, Source("code", "trl grpo_trainer.py _generate_and_score_completions")] = (
    2 * 8
)


# Every constant's source, read from its declaration (`Annotated[type, Source(...)]`): declared once, beside its value.
SOURCES: dict[str, Source] = {
    name: hint.__metadata__[0]
    for name, hint in get_type_hints(sys.modules[__name__], include_extras=True).items()
    if isinstance(getattr(hint, "__metadata__", (None,))[0], Source)
}
