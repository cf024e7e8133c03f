"""This GPU's device overheads measured without training: `lowmem-ft doctor --calibrate`, in seconds.

The memory model prices the CUDA context, cuBLAS' workspaces and the caching allocator's reserved bytes over its
allocated ones as constants (`lowmem_ft.memory.calibration`). Here each is measured on the device, by the smallest
thing that shows it, and recorded as a `lowmem_ft.calibrated.Measurement` (source "doctor") beside the model's figure:

- cuBLAS workspaces: the bytes the caching allocator holds after a process's first matmuls (a plain bf16 matmul and a
  `linear` with a bias, which takes the cuBLASLt path) beyond their inputs and outputs. torch allocates the handles'
  workspaces through its allocator on the first GEMM of a stream (aten/src/ATen/cuda/CublasHandlePool.cpp); where a
  build does not, they show in the context instead, and the two terms still sum to what the device holds.
- CUDA context: the device's used bytes (`torch.cuda.mem_get_info`: total − free) less torch's `memory_reserved`,
  after those matmuls and the model below (so the kernels they loaded count). The figure is the device's: another
  process on the same GPU counts in, so calibrate on an idle one.
- reserved over allocated: a small Llama (random weights, built from a config: no download) trained for a few AdamW
  steps in bf16 on batches padded to their longest sample, of lengths that vary as real batches do;
  `max_memory_reserved` − `max_memory_allocated` over those steps, against the model's allocator term for the same
  steps (`lowmem_ft.memory.overheads.allocator_bytes` of the measured transient — the allocated peak above what the
  step started with — for the allocator setting this process runs, `lowmem_ft.cuda_alloc`).

What a run measures instead is `lowmem_ft.train.observe.calibrating`'s: a real plan's phases, at its size. This is the
quick first reading a GPU gets before any run; both are kept, and each term takes the largest excess.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_ft.calibrated import Measurement
from lowmem_ft.cuda_alloc import setting_of, user_alloc_conf
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
from lowmem_ft.memory.overheads import allocator_block, allocator_bytes
from lowmem_ft.memory.records import Setup

# the small Llama's batches: rows × the longest sample of each (padded to it), lengths as a chat data set's vary
BATCHES = ((4, 384), (4, 512), (4, 256), (4, 448), (4, 320), (4, 512))
MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 32000}  # fmt: skip


@dataclass(frozen=True)
class Readings:
    """What the device said, in bytes."""

    used: int  # the device's used memory (total − free) at the end
    reserved: int  # torch's memory_reserved at the same moment
    workspace: int  # held by the allocator after the first matmuls beyond their tensors
    reserved_peak: int  # max_memory_reserved over the small model's steps
    allocated_peak: int  # max_memory_allocated over the same steps
    step_start: int  # memory_allocated when the largest step began (weights, optimizer states)


def measurement_of(r: Readings) -> Measurement:
    """The three terms, each as measured and as the model has it, under the allocator setting this process runs."""
    setting = setting_of(user_alloc_conf() or "")
    return Measurement(
        source="doctor",
        measured={
            "CUDA context": float(r.used - r.reserved),
            "cuBLAS workspaces": float(r.workspace),
            "reserved over allocated": float(r.reserved_peak - r.allocated_peak),
        },
        model={
            "CUDA context": CUDA_CONTEXT_BYTES,
            "cuBLAS workspaces": float(CUBLAS_WORKSPACE_BYTES),
            # the small Llama trains every weight, under the allocator setting this process runs
            "reserved over allocated": model_allocator_bytes(setting, r),
        },
        plan={"what": "doctor --calibrate: first matmuls, a small Llama's AdamW steps", "batches": list(BATCHES)},
        phases={},
        allocator=setting,
    )


def model_allocator_bytes(setting: str, r: Readings) -> float:
    """The memory model's allocator term for the small Llama's largest step under `setting`: its transient (the
    allocated peak above the step's start) and its blocks (its own loss over full logits, at the longest batch)."""
    arch = Architecture.from_config({**MODEL, "model_type": "llama"}, "doctor's small Llama")
    rows, longest = max(BATCHES, key=lambda b: b[0] * b[1])
    s = Setup(adapter="full", quantization="none", allocator=setting, loss_impl="hf_full", micro_batch_size=rows,
              max_seq_len=longest)  # fmt: skip
    return allocator_bytes(s, r.allocated_peak - r.step_start, block=allocator_block(arch, s))


def _workspace(torch, cuda) -> int:
    """Bytes the allocator holds after the process's first matmuls beyond the tensors they made."""
    a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    cuda.synchronize()
    before = cuda.memory_allocated()
    c = a @ a
    d = torch.nn.functional.linear(a, a, bias)  # with a bias: the cuBLASLt path and its own workspace
    cuda.synchronize()
    held = cuda.memory_allocated() - before - c.untyped_storage().nbytes() - d.untyped_storage().nbytes()
    del a, bias, c, d
    return max(0, held)


def _train_steps(torch, cuda) -> tuple[int, int, int]:
    """The small Llama's AdamW steps: (max reserved, max allocated, allocated at the start of the largest step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cuda.synchronize()
    cuda.reset_peak_memory_stats()
    start, largest = 0, 0
    for rows, length in BATCHES:
        ids = torch.randint(0, config.vocab_size, (rows, length), device="cuda")
        now = cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rows * length >= largest:
            start, largest = now, rows * length
    cuda.synchronize()
    peaks = cuda.max_memory_reserved(), cuda.max_memory_allocated()
    del model, opt
    return *peaks, start


def read() -> Readings:
    """Measure on the current CUDA device (the caller checked there is one)."""
    import torch

    cuda = torch.cuda
    cuda.init()
    workspace = _workspace(torch, cuda)
    reserved_peak, allocated_peak, step_start = _train_steps(torch, cuda)
    cuda.synchronize()
    free, total = cuda.mem_get_info()
    return Readings(total - free, cuda.memory_reserved(), workspace, reserved_peak, allocated_peak, step_start)
