"""The export's memory and disk, predicted before any weight is read, and a one-line refusal when they do not fit.

What the streamed export holds at once (`stream`, `gguf_file`):
- the adapter, loaded whole: its file's bytes, and an fp32 copy of A and B when it was saved in 16-bit (× 2 bound);
- one block of one tensor (`stream.BLOCK_ELEMENTS`), or one whole q/k projection where llama.cpp's row permutation
  needs it: `WORK_BYTES` per element — the stored value, its fp32 copy, the LoRA update, their sum, the encoded
  output. Measured: the process's anonymous resident memory (RssAnon, sampled every 2 ms) grew 275 MB with 4 Mi-element
  blocks and 403 MB with 16 Mi on a 221M-parameter bf16 Llama with a rank-16 adapter on every linear, f16 output:
  10.2 bytes per element of the block, 232 MB besides (`FIXED_BYTES`: the libraries' lazily imported modules, the
  tokenizer and its GGUF token lists). `devkit/bench/export_memory.py` measures it again;
- the shard's pages of the tensor being read (memory-mapped, file-backed: counted in the resident set while mapped,
  reclaimable by the kernel): the largest tensor's stored bytes (149 MB file-backed growth measured for a 131 MB
  embedding).
Nothing else scales with the model: a 70B base exports in host memory set by its largest tensor, not its size. This
replaces the 16-bit merge (`lowmem_ft.merging`: params × 2 bytes) that `lowmem-ft merge` and other tools' GGUF
export do.

The disk holds the output once (staged beside it under a hidden name, then renamed): the sum of every tensor's
bytes in its GGUF type, exact from the safetensors headers, plus the metadata (the tokenizer: `METADATA_BOUND`).
A K-quant (`llama_quant`) holds the f16 file and llama.cpp's output at once, the output counted at its Q8_0 size
(a bound: `llama_quant` says why), and its host memory is the larger of the merge's and the quantizer's.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from lowmem_ft.errors import UserError
from lowmem_ft.memory.inference import human

WORK_BYTES = 12  # per element of the block in flight: 10.2 measured (module docstring), rounded up
FIXED_BYTES = 256 << 20  # the export's own working set besides the block: 232 MB measured (module docstring)
METADATA_BOUND = 64 << 20  # tokenizer + chat template + keys: a 256k-token vocabulary's strings and merges ≈ 20 MB


@dataclass(frozen=True)
class ExportPlan:
    quant: str
    tensor_bytes: int  # the GGUF's tensor data, exact
    params: int
    adapter_bytes: int  # adapter file (0 for a full fine-tune)
    block_elements: int  # the largest block in flight
    mapped_bytes: int = 0  # the largest tensor's stored bytes: its shard pages while it is read
    # a K-quant (`llama_quant`): the f16 file written first and llama.cpp's quantizer over it
    intermediate_bytes: int = 0  # the f16 file's tensor bytes, on the output's disk until the quantizer is done
    quantizer_bytes: int = 0  # llama.cpp's quantizer besides this process (`llama_quant.host_bytes`)

    @property
    def disk(self) -> int:
        staged = self.intermediate_bytes + METADATA_BOUND if self.intermediate_bytes else 0
        return self.tensor_bytes + METADATA_BOUND + staged

    @property
    def merge_host(self) -> int:
        return 2 * self.adapter_bytes + FIXED_BYTES + self.block_elements * WORK_BYTES + self.mapped_bytes

    @property
    def host(self) -> int:
        # the quantizer runs after the merge, in this process, whose own working set stays
        return max(self.merge_host, FIXED_BYTES + self.quantizer_bytes)

    def describe(self) -> str:
        adapter = f"{human(2 * self.adapter_bytes)} adapter + " if self.adapter_bytes else ""
        merge = (
            f"{adapter}{human(FIXED_BYTES)} working set + {human(self.block_elements * WORK_BYTES)} for the block "
            f"of weights in flight + {human(self.mapped_bytes)} of mapped shard pages"
        )
        if not self.quantizer_bytes:
            return merge
        return f"the larger of the merge, {merge}, and llama.cpp's quantizer, {human(self.quantizer_bytes)}"


def make_plan(planned, quant: str, adapter_bytes: int, config) -> ExportPlan:
    """The plan for the tensors `gguf_file.plan_tensors` listed."""
    import math

    from lowmem_ft.export.families import family_of
    from lowmem_ft.export.stream import BLOCK_ELEMENTS

    family = family_of(config)
    largest_block = 0
    for p in planned:
        count = math.prod(p.ref.shape) if p.ref.shape else 1
        whole = family.transform(p.ref.name, config) is not None
        largest_block = max(largest_block, count if whole else min(count, BLOCK_ELEMENTS))
    return ExportPlan(
        quant=quant,
        tensor_bytes=sum(p.nbytes for p in planned),
        params=sum(math.prod(p.ref.shape) if p.ref.shape else 1 for p in planned),
        adapter_bytes=adapter_bytes,
        block_elements=largest_block,
        mapped_bytes=max((p.ref.stored_bytes for p in planned), default=0),
    )


def free_disk(output: Path) -> int:
    probe = output.resolve().parent
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_fits(plan: ExportPlan, host_budget: int, host_from: str, disk_free: int, output: Path,
               smaller: dict[str, int]) -> None:  # fmt: skip
    """One line when the host memory or the disk is too small, saying what would fit; `smaller` maps the other
    quant types to their disk size."""
    if plan.host > host_budget:
        raise UserError(
            f"the export needs {human(plan.host)} of host memory ({plan.describe()}) but {host_from} allows "
            f"{human(host_budget)}; free memory, or pass --host-ram GB if more is available"
        )
    if plan.disk > disk_free:
        fits = [f"--quant {q} ({human(size)})" for q, size in smaller.items() if size + METADATA_BOUND <= disk_free]
        also = f", or {' / '.join(fits)}" if fits else ""
        raise UserError(
            f"--output {output}: the {plan.quant} GGUF needs {human(plan.disk)} but its disk has {human(disk_free)} "
            f"free; write it to another disk with --output{also}"
        )
