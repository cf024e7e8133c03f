"""K-quants (Q4_K_M, Q5_K_M, Q6_K, …) through llama.cpp's own quantizer, run on the f16 GGUF that `gguf_file` writes.

The `gguf` package writes Q8_0 and the 32-weight block types in numpy, but not K-quants (its `quants.py` only reads
them), and a K-quant *mix* is llama.cpp's decision per tensor (Q4_K_M keeps attn_v and half the ffn_down in Q6_K,
the output matrix in Q6_K: `llama_tensor_get_type` in its llama-quant.cpp). So the export writes f16 under a hidden
name, hands it to `llama_model_quantize` (llama-cpp-python's binding of that C function, the one `llama-quantize`
runs), writes its output under a second hidden name and renames it when complete; the f16 file is removed
whatever happens. llama-cpp-python has no wheel on PyPI (it builds llama.cpp from source), so it is the optional
extra `gguf-quants`, and without it `--quant q4_k_m` is one line saying what to install.

Memory of the quantizer, read from llama-quant.cpp in llama-cpp-python 0.3.36: the input is
memory-mapped and each tensor unmapped once written (file-backed pages: the largest tensor's f16 bytes); its rows
go through in slabs whose source bytes, fp32 copy and output stay under `max_buf_size`, set here to `SLAB_BYTES`
(llama.cpp's default is 8 GiB); the loader holds the file's metadata (the tokenizer: `plan.METADATA_BOUND`).
Measured (`devkit/bench/export_memory.py`, a 221M-parameter bf16 Llama, q4_k_m): predicted 735 MB, the process grew
526 MB anonymous + 144 MB file-backed at its peak, during the quantizer (the f16 merge alone: 266 + 143 MB).
Disk: the f16 file and the output at once. The output is at most the Q8_0 file: a K-quant, and llama.cpp's
fallback for a tensor whose rows are not a multiple of 256 (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0:
`tensor_type_fallback`), is never wider than Q8_0, and rows not a multiple of 32 stay F16 in both — so the plan
counts the Q8_0 size, a bound and not the exact size.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from lowmem_ft.errors import UserError

# --quant → llama.cpp's llama_ftype (llama.h `LLAMA_FTYPE_MOSTLY_*`)
LLAMA_QUANTS = {
    "q4_k_m": "Q4_K_M",
    "q4_k_s": "Q4_K_S",
    "q5_k_m": "Q5_K_M",
    "q5_k_s": "Q5_K_S",
    "q6_k": "Q6_K",
    "q3_k_m": "Q3_K_M",
    "q3_k_l": "Q3_K_L",
    "q2_k": "Q2_K",
    # the 32-weight block types: the gguf package could write these in numpy, but llama.cpp's mix for them keeps the
    # output matrix in Q6_K (a K-quant), which a pure-numpy file cannot; so they go through llama.cpp too
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q5_0": "Q5_0",
    "q5_1": "Q5_1",
}
SLAB_BYTES = 256 << 20  # llama_model_quantize_params.max_buf_size: rows in flight per tensor (module docstring)
EXTRA = "pip install 'lowmem-ft[gguf-quants]'"


def require(quant: str) -> None:
    """One line when llama-cpp-python is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError(
            f"--quant {quant} needs llama.cpp's quantizer from llama-cpp-python: {EXTRA} (it builds llama.cpp from "
            f"source: a C++ compiler and cmake), or export --quant f16 and run llama.cpp's llama-quantize on it"
        )


def host_bytes(largest_f16_tensor: int) -> int:
    """What the quantizer holds besides this process: one slab, the mapped tensor, the file's metadata."""
    from lowmem_ft.export.plan import METADATA_BOUND

    return SLAB_BYTES + largest_f16_tensor + METADATA_BOUND


def make_plan(planned_f16: list, quant: str, adapter_bytes: int, config):
    """The export plan of a K-quant (`plan.ExportPlan`) over the f16 tensors `gguf_file.plan_tensors` listed: the
    merge writes them, the output is counted at its Q8_0 size (module docstring), llama.cpp's quantizer beside."""
    import dataclasses

    from lowmem_ft.export import plan
    from lowmem_ft.export.gguf_file import nbytes, tensor_qtype

    merge = plan.make_plan(planned_f16, quant, adapter_bytes, config)
    bound = sum(nbytes(p.ref.shape, tensor_qtype(p.ref.shape, "q8_0")) for p in planned_f16)
    largest = max(p.nbytes for p in planned_f16)
    return dataclasses.replace(merge, tensor_bytes=bound, intermediate_bytes=merge.tensor_bytes,
                               quantizer_bytes=host_bytes(largest))  # fmt: skip


def quantize(source: Path, output: Path, quant: str, threads: int | None = None) -> None:
    """llama.cpp's quantizer from the GGUF `source` to `output` (atomically: staged beside it, renamed when done)."""
    import llama_cpp

    messages: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(level, text, _user):  # llama.cpp logs a line per tensor: keep them for an error, print none
        messages.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{LLAMA_QUANTS[quant]}")
    params.nthread = threads or max(1, len(os.sched_getaffinity(0)))
    params.max_buf_size = SLAB_BYTES
    staged = output.parent / f".{output.name}.partial-{os.getpid()}"
    try:
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(staged).encode(), ctypes.byref(params))
        if failed:
            why = next((m.strip() for m in reversed(messages) if "error" in m.lower() or "failed" in m.lower()), "")
            raise UserError(
                f"llama.cpp's quantizer failed on {source} ({why or 'no message'}); --quant f16, bf16 or q8_0 "
                "are written without it"
            )
        os.replace(staged, output)
    finally:
        staged.unlink(missing_ok=True)
        from llama_cpp import _logger  # llama-cpp-python's own callback, which it sets on import

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def write_quantized(
    write_f16: Callable[[Path], object],
    output: Path,
    quant: str,
    threads: int | None = None,
    on_quantize: Callable[[], None] | None = None,
) -> None:
    """`write_f16(path)` writes the f16 GGUF to a hidden path beside `output`; llama.cpp quantizes it to `output`;
    the f16 file is removed whatever happens."""
    f16 = output.parent / f".{output.name}.partial-f16-{os.getpid()}"
    try:
        write_f16(f16)
        if on_quantize is not None:
            on_quantize()
        quantize(f16, output, quant, threads)
    finally:
        f16.unlink(missing_ok=True)
