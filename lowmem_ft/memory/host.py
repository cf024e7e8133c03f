"""Host RAM as a planning limit: what an estimate keeps in host memory, on the whole machine, against the target's
host budget (pure arithmetic; the machine's RAM is detected outside the memory model, `lowmem_ft.choosing`).

The one idea: the estimate's "host" components (offloaded layer inputs, input embeddings on the host, paged optimizer
states, offloaded model states) are per process; the processes of one node share its RAM, so they add up (the
target's `node_gpus`: a run over several nodes counts the processes of one).
"""

from __future__ import annotations

from lowmem_ft.memory.records import GB, Estimate
from lowmem_ft.memory.target import Target


def host_need_gb(est: Estimate, gpus: int = 1) -> float:
    """Host RAM an estimate keeps on the machine: its "host" components (per process) × the processes of one node.
    Paged optimizer states count in full: bitsandbytes evicts them to host memory under device pressure, and a
    plan must not rely on the pressure never coming."""
    return gpus * sum(c.bytes for c in est.components if c.phase == "host") / GB


def host_over(est: Estimate, target: Target) -> str:
    """The words of a host-RAM need over the target's host budget: how much, of what, against which RAM."""
    parts = ", ".join(f"{c.name} {c.gb:.2f}" for c in est.components if c.phase == "host" and c.bytes > 0)
    per = f" (× {target.node_gpus} processes)" if target.node_gpus > 1 else ""
    return (
        f"keeps {host_need_gb(est, target.node_gpus):.1f} GB in host RAM ({parts}){per}, over the "
        f"{target.host_budget_gb:.1f} GB host budget (--host-ram {target.host_ram_gb:g} − margin "
        f"{target.host_margin_gb:g}, memory.host_margin_gb)"
    )
