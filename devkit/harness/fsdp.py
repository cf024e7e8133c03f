"""FSDP2 on CPU ranks, every rank measured exactly: the yardstick of the per-device plan (`memory.sharding`).

Why a harness and not `lowmem-ft train --gpus N --strategy fsdp`: accelerate 1.16 cannot run FSDP on the CPU. Its
launcher sends an FSDP config with `use_cpu` to the one-process `simple_launcher` (commands/launch.py
`launch_command`: `elif args.use_fsdp and not args.cpu`), and in the processes `AcceleratorState` turns the FSDP
plugin on only for accelerator process groups: with `cpu=True`, `_prepare_backend` makes the run MULTI_CPU (gloo)
and the branch that sets `DistributedType.FSDP` (state.py, under `elif self.distributed_type in [MULTI_GPU, …]`)
is never reached — checked: `Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`
under torchrun on 2 processes reports `DistributedType.MULTI_CPU` and no plugin. torch itself runs FSDP2 on gloo,
so this harness calls accelerate's own FSDP2 preparation (utils/fsdp_utils.py `fsdp2_prepare_model`: one
`fully_shard` per decoder layer class of `_no_split_modules`, an untied input embedding and the final norm + LM head
as units of their own, then the root) on a gloo device mesh, with the plugin our launch config gives
(`lowmem_ft.train.trace.sharded.shard_as_accelerate`), while the product path stays on accelerate.

One grid point = N processes (`torch.multiprocessing`) on one gloo group, forked from a server process that imported
the training stack once (multiprocessing's forkserver, preloaded: `PRELOAD`) — a spawned rank spent ~8 s of CPU
importing torch, transformers, peft and TRL, most of a small point's time, and a fork of the clean server starts with
none of the caller's state. Each rank builds the model through
`lowmem_ft.train.model.build_model` (the path `train` uses), installs TRL's fused LM head as `SFTTrainer` does,
shards it, creates the optimizer the way transformers' Trainer does, and runs `measure.peak.measured_step`'s two
optimizer steps under `PeakMemory` with `storage_resizes` on (FSDP2 gathers a unit by growing its parameters'
storages in place) — every rank its own exact live tensor bytes per phase.

gloo's reduce-scatter, and why each mark first waits for gloo's worker threads: gloo has no reduce-scatter of its
own. `ProcessGroupGloo::reduce_scatter_tensor_coalesced` (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, reached
from FSDP2's `foreach_reduce` → `dist.reduce_scatter_single`) clones the whole input
(`buffers.push_back(inputTensors[i].clone())`), all-reduces the clone on a gloo worker thread, and copies this
rank's chunk out when the caller waits. The worker thread drops its reference to the finished all-reduce (and so to
the clone: N × the unit's gradient shard, the root unit's after the root's post-backward) only after the caller has
resumed, and freeing a storage that has a Python object (the counting gives it one) needs the GIL, which the
training thread holds until it next releases it. So a unit-sized clone stayed alive after the backward for a
moment that depended on thread scheduling: the full fine-tunes' static state and optimizer step measured 16–38 %
high on some ranks, first read as reference cycles because `gc.collect()` freed it; `time.sleep`, which only
releases the GIL, frees it just as well (checked: 21,438,588 → 17,243,772 live bytes on llama3 full, 2 ranks, rank
0 after micro-step 2.1). NCCL reduce-scatters in place (no clone) and a real training loop releases the GIL all
the time (data loading, logging), so the block belongs to neither the plan nor a GPU run. The harness installs
FSDP2's own reduce-scatter call through `set_custom_reduce_scatter`, noting which storages gloo allocates inside it,
and before each mark releases the GIL until every one of them is freed (a wait for that event, not a fixed sleep),
for at most 5 s: once (llama3 full, 2 ranks, checkpointing) a clone outlived 60 s of waiting, so something besides
the worker thread can hold it; that holder is not found, and such a clone is counted as live.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from devkit.harness.estimator import Point, recipe_for, trainer_batches
from lowmem_ft.train.trace.sharded import MESH_DIM

# what the ranks import, imported once by the server they fork from (`_start`)
PRELOAD = ["torch", "transformers", "peft", "trl", "bitsandbytes", "devkit.harness.fsdp", "lowmem_ft.train.model",
           "lowmem_ft.train.measure.peak", "lowmem_ft.train.trace.sharded"]  # fmt: skip

PHASES = ("static", "forward", "backward", "optimizer step")


@dataclass
class FsdpPoint:
    family: str
    adapter: str  # full | lora
    ranks: int
    checkpointing: bool
    batch: int = 2
    seq: int = 128
    optimizer: str = "adamw_torch"
    # rank → phase → (peak bytes within the phase, live bytes at its end), as `devkit.harness.estimator.measure`
    phases: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)

    def point(self) -> Point:
        """The single-device harness's point of the same setup (its recipe and prediction)."""
        return Point(self.family, self.adapter, self.optimizer, self.checkpointing, self.batch, self.seq)


def _settled_peak_memory(**kwargs):
    """A `PeakMemory` that knows which storages gloo's reduce-scatters allocate (`watch`) and, before each mark,
    waits for those to be freed (module docstring): the GIL is released in 1 ms sleeps until the freeing callback
    of every one has run (at most 5 s), so a phase ends where it would without gloo's clone."""
    from lowmem_ft.train.measure.peak import PeakMemory

    class SettledPeakMemory(PeakMemory):
        def __post_init__(self):
            super().__post_init__()
            self.log = []  # ("+" / "-", storage key, bytes), read by `watch` and `mark`
            self.clones: set[object] = set()
            self._read = 0

        def watch(self, start: int, nbytes: int) -> None:
            """Storages of `nbytes` (the reduce-scatter input's: gloo's clone) allocated since log entry `start`
            (within a reduce-scatter) and not yet freed."""
            for kind, key, size in self.log[start:]:
                if kind == "+" and size == nbytes:
                    self.clones.add(key)
                elif kind == "-":
                    self.clones.discard(key)
            self._read = len(self.log)

        def mark(self, label: str):
            deadline = time.monotonic() + 5
            while True:
                end = len(self.log)
                self.clones.difference_update(key for kind, key, _ in self.log[self._read : end] if kind == "-")
                self._read = end
                if not self.clones:
                    return super().mark(label)
                if time.monotonic() > deadline:  # held elsewhere too (seen once in 24 points): counted as live
                    self.clones.clear()
                    return super().mark(label)
                time.sleep(0.001)  # releases the GIL: gloo's worker thread drops its finished all-reduce

    return SettledPeakMemory(**kwargs)


def _watched_reduce_scatter(pm):
    """FSDP2's default reduce-scatter (torch _fsdp_collectives.py `DefaultReduceScatter`, the same call), telling
    `pm` what gloo allocates inside it; installed with the public `FSDPModule.set_custom_reduce_scatter`."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class WatchedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            start = len(pm.log)
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            pm.watch(start, input_tensor.untyped_storage().nbytes())
            return work

    return WatchedReduceScatter()


def _vocab(base) -> int:
    """Token ids the model embeds (its input embedding's rows: a vision-language config keeps `vocab_size` in
    its text config)."""
    return base.get_input_embeddings().num_embeddings


def shard(model, mesh, recipe) -> None:
    """Shard `model` as a run's accelerate would: its own `fsdp2_prepare_model` with the FSDP2 plugin our launch
    config gives and the CPU processes' mixed precision ("no"), through `lowmem_ft.train.trace.sharded` (one
    `fully_shard` per decoder layer, the untied input embedding and the final norm + LM head as units of their own,
    then the root)."""
    from lowmem_ft.train.trace.sharded import shard_as_accelerate

    shard_as_accelerate(model, mesh, recipe, "no")


def _rank(rank: int, world: int, model_dir: str, p: FsdpPoint, init: str, out: str, warmup_seq: int) -> None:
    """One rank of a point: build, shard, two measured optimizer steps; writes `rank{r}.json` to `out`."""
    import torch
    from torch import distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from transformers import TrainingArguments
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.train.args import OPTIM_NAMES
    from lowmem_ft.train.measure.peak import STEPS, fused_head_loss, measured_step, trainer_optimizer
    from lowmem_ft.train.model import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(MESH_DIM,))
        torch.manual_seed(0)
        recipe = recipe_for(Path(model_dir), p.point())
        model = build_model(recipe)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer.__init__ does
        model.train()
        shard(model, mesh, recipe)
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim=OPTIM_NAMES[p.optimizer], use_cpu=True)
        optimizer = trainer_optimizer(model, args)
        trainable = [q for q in model.parameters() if q.requires_grad]
        gen = torch.Generator().manual_seed(1 + rank)  # each rank its own micro batches, as a sampler gives them
        pm = _settled_peak_memory(roots=[model, optimizer.state], storage_resizes=True)
        comm = _watched_reduce_scatter(pm)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)
        with pm:
            pm.mark("static")
            lengths = [p.seq if s == (2, 2) else warmup_seq for s in STEPS]
            batches = trainer_batches(_vocab(base), p.batch, lengths, gen)
            measured_step(pm, batches, partial(fused_head_loss, model), optimizer, trainable)
            phases = {m.label: (m.peak_bytes, m.live_bytes) for m in pm.marks}
            phases["peak"] = (pm.peak_bytes, pm.live_bytes)
        Path(out, f"rank{rank}.json").write_text(json.dumps(phases))
    finally:
        dist.destroy_process_group()


def _loss_rank(rank: int, world: int, jobs: list[tuple[str, FsdpPoint]], init: str, out: str) -> None:
    """One rank of `sharded_losses`: for each job in turn, the loss of the same batch on every rank, and after one
    optimizer step — every job in one process group (the ranks import the libraries once for all of them)."""
    import torch
    from torch import distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(MESH_DIM,))
        for i, (model_dir, p) in enumerate(jobs):
            model = _built(model_dir, p)
            shard(model, mesh, recipe_for(Path(model_dir), p.point()))
            Path(out, f"loss{i}.rank{rank}.json").write_text(json.dumps(_two_losses(model, p)))
    finally:
        dist.destroy_process_group()


def _built(model_dir: str, p: FsdpPoint):
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.train.model import build_model

    torch.manual_seed(0)
    model = build_model(recipe_for(Path(model_dir), p.point()))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
    model.train()
    return model


def _two_losses(model, p: FsdpPoint) -> list[float]:
    """The loss of one fixed batch, one SGD step (lr 1e-2: plain arithmetic, the same on shards and whole), and
    the loss of the same batch again: equal losses before and after say the gathered weights and the reduced
    gradients are the whole model's."""
    import torch

    from lowmem_ft.train.measure.peak import fused_head_loss

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    batch = next(trainer_batches(_vocab(base), p.batch, [p.seq], torch.Generator().manual_seed(7)))
    optimizer = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=1e-2)
    first, _ = fused_head_loss(model, batch)
    first.backward()
    optimizer.step()
    with torch.no_grad():
        second, _ = fused_head_loss(model, batch)
    return [first.item(), second.item()]


def sharded_loss(model_dir: Path, p: FsdpPoint) -> tuple[list[float], dict[int, list[float]]]:
    """(the whole model's [loss, loss after one step], each rank's under FSDP2 on `p.ranks` ranks) for one batch
    given to every rank: sharding must change neither (data parallelism averages equal gradients)."""
    return sharded_losses([(model_dir, p)])[0]


def sharded_losses(jobs: list[tuple[Path, FsdpPoint]]) -> list[tuple[list[float], dict[int, list[float]]]]:
    """`sharded_loss` of each (model directory, point), the points' ranks started once for all of them (one
    `start_processes`: the ranks' imports are most of a small point's time). Every point has the same `ranks`."""
    (world,) = {p.ranks for _, p in jobs}
    wholes = [_two_losses(_built(str(model_dir), p), p) for model_dir, p in jobs]
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        work = [(str(model_dir), p) for model_dir, p in jobs]
        _start(_loss_rank, (world, work, init, tmp), world)
        return [
            (whole, {r: json.loads(Path(tmp, f"loss{i}.rank{r}.json").read_text()) for r in range(world)})
            for i, whole in enumerate(wholes)
        ]


def measure(model_dir: Path, p: FsdpPoint, warmup_seq: int = 8) -> dict[int, dict[str, tuple[int, int]]]:
    """Run point `p` on `p.ranks` CPU processes; rank → phase → (peak, live at end)."""
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        _start(_rank, (p.ranks, str(model_dir), p, init, tmp, warmup_seq), p.ranks)
        return {
            r: {k: tuple(v) for k, v in json.loads(Path(tmp, f"rank{r}.json").read_text()).items()}
            for r in range(p.ranks)
        }


def _start(fn, args: tuple, ranks: int) -> None:
    """Run `fn(rank, *args)` on `ranks` processes forked from the preloaded server (started by the first call of
    this process, with its environment then) and wait for them; a rank's exception is raised here."""
    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=ranks, start_method="forkserver")


def phase_measurements(phases: dict[str, tuple[int, int]]) -> dict[str, int]:
    """One rank's measured peak per phase of the steady-state step (micro-step 2.2: states and accumulated
    gradients exist), as `devkit.harness.estimator.phase_measurements` reads a single device."""
    return {
        "static": phases["backward 2.1"][1],
        "forward": phases["forward 2.2"][0],
        "backward": phases["backward 2.2"][0],
        "optimizer step": phases["optimizer 2"][0],
    }


def to_json(p: FsdpPoint) -> dict:
    return asdict(p)
