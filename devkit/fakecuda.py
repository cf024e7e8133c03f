"""Fake CUDA on a CPU-only torch: the step's CUDA code paths on FakeTensors whose device is `cuda`, without a GPU.

    python -m devkit.fakecuda          # compiles the shim (g++, ~15 s), then compares CPU and fake-CUDA kernels

What a CPU-only torch 2.13 does with `FakeTensorMode` and `device="cuda"` (found here, each step tested):
- Factories and forward operators work: fake mode answers from the operators' meta kernels, which know CUDA.
- The backward does not: autograd's `InputMetadata` asks the CUDA device guard for a stream, and a CPU build has
  none ("PyTorch is not linked with support for cuda devices": a C++ abort, not an exception); with a guard, the
  engine asks for the accelerator ("Cannot access accelerator device when none is available": `getCUDAHooks()`),
  then records events on it.
- SDPA on fake CUDA tensors silently takes the **math** path (`_safe_softmax`, b·h·s² scores kept for backward):
  `scaled_dot_product_attention` calls the kernel-choice stub `_fused_sdp_choice_stub` for the device directly (not
  through the dispatcher, so no Python registration reaches it), and a CPU build has no CUDA entry. A fake-CUDA trace
  without the shim is *less* faithful than the CPU trace, whose CPU flash kernel keeps no scores.

`SOURCE` is a small C++ shim that fills those three holes and nothing else: a no-op CUDA device guard (one device,
one default stream, events that do nothing), CUDA hooks that say one device exists (registered under the name
`getCUDAHooks()` looks up, so it must be loaded before torch is imported: torch's import creates the hooks once), and
the CUDA build's SDPA choice, simplified from aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: flash attention
for fp16/bf16 without a mask and head dim ≤ 256 (a multiple of 8), else memory-efficient attention, else math (the
real one also checks the GPU's compute capability, dropout, nested tensors and `torch.backends.cuda` flags).
With it, a tiny Llama's forward and backward run on fake CUDA tensors through `_scaled_dot_product_flash_attention`
(no mask) or `_scaled_dot_product_efficient_attention` (a mask) and their backward kernels' meta functions.

Not done: the tracer (`lowmem_ft.train.trace.step`) keeps data real and weights fake on the CPU, which keeps transformers
on the real run's mask path; on fake CUDA the data would be fake too (a real tensor cannot live on a CUDA device
here), and transformers would build the masks a traced run builds. bitsandbytes' CUDA paths were not tried.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SOURCE = r"""
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/Tensor.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/native/transformers/attention.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace at {
namespace fake {
struct CUDAHooks : public CUDAHooksInterface {
  CUDAHooks(CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool isBuilt() const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
};
}  // namespace fake
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, fake::CUDAHooks);
}  // namespace at

namespace {
using c10::Device;
using c10::DeviceType;
using c10::Stream;
struct FakeCUDAGuard final : public c10::impl::NoOpDeviceGuardImpl<DeviceType::CUDA> {
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream getDefaultStream(Device d) const override { return getStream(d); }
  Stream exchangeStream(Stream) const noexcept override { return getStream(Device(DeviceType::CUDA, 0)); }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, FakeCUDAGuard);

// sdp::SDPBackend: math 0, flash 1, efficient 2
int64_t sdp_choice(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>& mask,
                   double, bool, std::optional<double>, bool) {
  bool half = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
  int64_t d = q.sym_size(-1).guard_int(__FILE__, __LINE__);
  if (half && !mask.has_value() && d <= 256 && d % 8 == 0) return 1;
  if (d % 8 == 0) return 2;
  return 0;
}
}  // namespace
namespace at::native {
REGISTER_CUDA_DISPATCH(_fused_sdp_choice_stub, &sdp_choice);
}
"""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")  # without importing torch: the shim must load first
    if spec is None or spec.origin is None:
        raise RuntimeError("torch is not installed")
    return Path(spec.origin).parent


def build(cache: Path | None = None) -> Path:
    """Compile the shim against the installed torch (once per source and torch build); its path."""
    torch_dir = _torch_dir()
    key = hashlib.sha256((SOURCE + str(torch_dir)).encode()).hexdigest()[:16]
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lowmem-ft"
    out = cache / f"fakecuda-{key}.so"
    if out.is_file():
        return out
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("fake CUDA needs a C++ compiler (g++) to build its shim")
    cache.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cpp")
    src.write_text(SOURCE)
    lib = torch_dir / "lib"
    cmd = [compiler, "-O1", "-shared", "-fPIC", "-std=c++17", f"-I{torch_dir / 'include'}",
           f"-I{sysconfig.get_paths()['include']}", str(src), f"-L{lib}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{lib}", "-o", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def load() -> None:
    """Build and load the shim; call before the first `import torch` of the process."""
    if "torch" in sys.modules:
        raise RuntimeError("load the fake CUDA shim before importing torch (torch's import fixes the CUDA hooks)")
    ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL)


def _step(device: str, mask: bool) -> dict:
    """A tiny Llama's forward and backward (bf16, 2 × 512 tokens) under FakeTensorMode on `device`: the attention
    and softmax kernels it ran and `PeakMemory`'s peak per phase."""
    from collections import Counter

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowmem_ft.train.measure.peak import PeakMemory

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in str(func) or "softmax" in str(func):
                self.seen[str(func)] += 1
            return func(*args, **(kwargs or {}))

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, attn_implementation="sdpa")  # fmt: skip
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            model = LlamaForCausalLM(config)
        torch.set_default_dtype(torch.float32)
        ids = torch.zeros(2, 512, dtype=torch.long, device=device)
        extra = {"attention_mask": torch.ones_like(ids)} if mask else {}
        kernels = Kernels()
        with PeakMemory(device=device, roots=[model]) as pm, kernels:
            out = model(input_ids=ids, labels=ids, **extra)
            pm.mark("forward")
            out.loss.backward()
            del out
            pm.mark("backward")
    return {"kernels": sorted(kernels.seen), "peaks": {m.label: m.peak_bytes for m in pm.marks}}


def compare() -> list[dict]:
    """Each case (no mask / a mask) on the CPU and on fake CUDA, each in its own process (the shim changes torch's
    view of CUDA for the whole process)."""
    rows = []
    for mask in (False, True):
        for device in ("cpu", "cuda"):
            cmd = [sys.executable, "-m", "devkit.fakecuda", "--child", device] + (["--mask"] if mask else [])
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:  # a C++ abort says why only on stderr
                raise RuntimeError(f"{' '.join(cmd[1:])} exited {done.returncode}: {done.stderr[-2000:]}")
            rows.append({"device": device, "mask": mask, **json.loads(done.stdout.strip().splitlines()[-1])})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=("cpu", "cuda"), help=argparse.SUPPRESS)
    parser.add_argument("--mask", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.child == "cuda":
            load()
        print(json.dumps(_step(args.child, args.mask)))
        return 0
    for r in compare():
        attention = [k for k in r["kernels"] if "attention" in k or "safe_softmax" in k]
        print(f"{r['device']:4} mask={r['mask']!s:5} forward {r['peaks']['forward']:>10} B  backward "
              f"{r['peaks']['backward']:>10} B  {', '.join(attention)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
