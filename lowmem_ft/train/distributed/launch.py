"""Training on several devices: the accelerate configuration for a strategy, the checks before launch, the launch.

The one idea: lowmem-ft has no distributed runtime of its own. `train --gpus N` writes the resolved recipe and an
accelerate config (DDP, FSDP full shard, DeepSpeed ZeRO-2/3) into the run directory and hands the run to
`accelerate launch` (torchrun underneath), whose processes run `lowmem-ft train --run-dir RUN_DIR` — the same
single build path as one device. Combinations the installed libraries cannot run fail here, in one line, before
anything starts.

Without CUDA the processes are CPU ranks on the gloo backend: accelerate 1.15 starts N local processes only for
MULTI_GPU / FSDP / DeepSpeed configs (commands/launch.py `launch_command`: MULTI_CPU goes to the one-process or
mpirun `simple_launcher`), so the config says MULTI_GPU with `use_cpu: true`, and the trainer's `use_cpu` makes each
process a gloo rank (state.py `_prepare_backend`).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml

from lowmem_ft.choosing import Choice
from lowmem_ft.errors import UserError
from lowmem_ft.memory.planner import Requested
from lowmem_ft.memory.sharding import OFFLOAD_OPTIMIZERS, fsdp_version
from lowmem_ft.recipe.schema import Recipe
from lowmem_ft.rundir import RunDir

REQUESTED: tuple[str, ...] = get_args(Requested)
# recipe optimizers that run on the CPU when offloaded: bitsandbytes 8-bit and paged optimizers are CUDA kernels
CPU_OPTIMIZERS = OFFLOAD_OPTIMIZERS


@dataclass
class LaunchPlan:
    """How a multi-process run is launched; written to the run directory as launch.json."""

    gpus: int  # processes per node
    nodes: int = 1
    strategy: str = "ddp"  # ddp | fsdp | zero2 | zero3 (resolved)
    offload: bool = False  # optimizer states (ZeRO) / parameters + optimizer (FSDP) in host memory
    cpu: bool = False  # no CUDA: CPU processes on gloo
    reason: str = ""
    accelerate_args: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "world_size": self.world_size}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchPlan:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_launch(
    recipe: Recipe,
    *,
    gpus: int,
    nodes: int = 1,
    strategy: str = "auto",
    offload: bool = False,
    accelerate_args: list[str] | None = None,
    planned: Choice | None = None,
) -> LaunchPlan:
    """Resolve the strategy and check that the installed stack can run it; a UserError says why not.

    `planned` is the record of `choose_recipe`: with --vram (gpus > 1) the planner chose the strategy and offload
    from the per-device memory model (`lowmem_ft.memory.planner`), and a user-given --strategy was checked there.
    """
    if gpus < 1 or nodes < 1:
        raise UserError(f"--gpus {gpus} --nodes {nodes}: both must be at least 1")
    if strategy not in REQUESTED:
        raise UserError(f"--strategy {strategy}: choose one of {', '.join(REQUESTED)}")
    devices = cuda_devices()
    cpu = devices == 0
    if not cpu and gpus > devices:
        raise UserError(f"--gpus {gpus}: this machine has {devices} CUDA device(s); pass --gpus {devices} or fewer")
    reason = "as asked (--strategy)"
    if planned is not None and planned.strategy != "single":
        strategy, offload = planned.strategy, planned.offload
        reason = planned.reasons.get("strategy", reason)
    elif strategy == "auto":
        strategy, reason = auto_strategy(recipe, offload, cpu)
    plan = LaunchPlan(gpus, nodes, strategy, offload, cpu, reason, list(accelerate_args or []))
    check(recipe, plan)
    return plan


def auto_strategy(recipe: Recipe, offload: bool, cpu: bool = False) -> tuple[str, str]:
    """Without --vram there is no budget to plan against: DDP unless offload asks for sharding or a full fine-tune
    replicates 16+ B/param. With --vram the planner's per-device choice is used instead (see `plan_launch`).
    On the CPU accelerate runs DDP only (`check`), so a full fine-tune stays on DDP there.
    """
    if offload:
        return "fsdp", "offload asked: FSDP offloads parameters and optimizer states to host memory"
    if recipe.adapter.kind == "full" and cpu:
        return "ddp", "full fine-tune on CPU processes: accelerate shards (FSDP) only on GPUs, see docs/fsdp.md"
    if recipe.adapter.kind == "full":
        return "fsdp", "full fine-tune: weights, gradients and optimizer states sharded over the devices"
    return "ddp", "adapters: the base model and the LoRA states fit whole on each device"


def check(recipe: Recipe, plan: LaunchPlan) -> None:
    """One clear error for each combination the installed versions cannot run."""
    s, m = plan.strategy, recipe.model
    if s in ("zero2", "zero3") and importlib.util.find_spec("deepspeed") is None:
        raise UserError(f"--strategy {s} needs DeepSpeed, which is not installed: pip install deepspeed")
    if plan.cpu and s != "ddp":
        # accelerate 1.16: an FSDP / DeepSpeed config with use_cpu goes to the one-process launcher
        # (commands/launch.py `launch_command`: `elif args.use_fsdp and not args.cpu`), and AcceleratorState turns
        # FSDP on only for accelerator process groups (state.py: a CPU run is MULTI_CPU, whose branch never sets
        # DistributedType.FSDP; DeepSpeed: `ACCELERATE_USE_DEEPSPEED ... and not cpu`). docs/fsdp.md says more.
        raise UserError(
            f"--strategy {s} needs CUDA GPUs: accelerate runs FSDP and DeepSpeed only on accelerators (on the CPU "
            "it makes the processes plain gloo ranks and drops the sharding); use --strategy ddp"
        )
    if s != "ddp" and m.quantization == "int8":
        raise UserError(
            f"--strategy {s} cannot shard model.quantization=int8 (bitsandbytes int8 weights have no float storage "
            "dtype to shard); use --set model.quantization=nf4 or --strategy ddp"
        )
    if plan.offload and s == "ddp":
        raise UserError("--offload needs a sharded strategy (DDP keeps everything on the device); use --strategy fsdp")
    if plan.offload and recipe.optimizer.name not in CPU_OPTIMIZERS:
        raise UserError(
            f"--offload runs the optimizer step on the CPU, which optimizer.name={recipe.optimizer.name} cannot "
            "(bitsandbytes 8-bit/paged optimizers are CUDA kernels); use --set optimizer.name=adamw_torch"
        )
    if plan.nodes > 1 and not any("main_process_ip" in a for a in plan.accelerate_args):
        raise UserError(
            f"--nodes {plan.nodes} needs the address of the first node: add --accelerate-arg=--main_process_ip=HOST "
            "(and --accelerate-arg=--machine_rank=R on node R)"
        )


def layer_class(recipe: Recipe) -> str:
    """The decoder layer class FSDP wraps as one unit: the model class's `_no_split_modules` (built on `meta`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_ft.train.model import load_config

    config = load_config(recipe)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    names = list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise UserError(
            f"model '{recipe.model.name_or_path}' does not name its layer class (_no_split_modules), so FSDP cannot "
            "wrap it layer by layer; use --strategy ddp or zero3"
        )
    return ",".join(names)


def mixed_precision(recipe: Recipe, plan: LaunchPlan) -> str:
    """What `args.sft_config` will ask the trainer for, so accelerate's setting agrees with it."""
    if plan.cpu:
        return "no"
    return {"bfloat16": "bf16", "float16": "fp16"}.get(recipe.model.compute_dtype, "no")


def accelerate_config(recipe: Recipe, plan: LaunchPlan, layer_cls: str | None = None) -> dict[str, Any]:
    """The accelerate config file (the keys `accelerate config` writes, accelerate 1.15 config_args.py)."""
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MULTI_GPU",
        "mixed_precision": mixed_precision(recipe, plan),
        "num_machines": plan.nodes,
        "num_processes": plan.world_size,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": plan.cpu,
    }
    if plan.nodes == 1:
        config["main_process_port"] = 0  # launch.py prepare_multi_gpu_env: 0 picks a free port
    if plan.strategy == "fsdp":
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = fsdp_config(recipe, plan, layer_cls)
    elif plan.strategy in ("zero2", "zero3"):
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "zero_stage": 3 if plan.strategy == "zero3" else 2,
            "offload_optimizer_device": "cpu" if plan.offload else "none",
            "offload_param_device": "none",
            "gradient_accumulation_steps": recipe.memory.gradient_accumulation,
            "gradient_clipping": recipe.optimizer.max_grad_norm,
            # ZeRO-3 builds the model already partitioned (peft's DeepSpeed QLoRA guide: zero3_init_flag true)
            "zero3_init_flag": plan.strategy == "zero3",
            "zero3_save_16bit_model": plan.strategy == "zero3",
        }
    return config


def fsdp_config(recipe: Recipe, plan: LaunchPlan, layer_cls: str | None) -> dict[str, Any]:
    """accelerate's `fsdp_config`, FSDP2 or FSDP1 as `memory.sharding.fsdp_version` decides (the plan's reason line
    says which), with the keys `accelerate config` writes for that version (accelerate 1.16 commands/config/cluster.py:
    FSDP2 has no sharding strategy, backward prefetch, use_orig_params or sync_module_states)."""
    version = fsdp_version(recipe.model.quantization)[0]
    common = {
        "fsdp_version": version,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": layer_cls,
        "fsdp_offload_params": plan.offload,
        # rank 0 reads the weights, the others get them by broadcast
        "fsdp_cpu_ram_efficient_loading": True,
        # resumable sharded checkpoints; run.FineTune.finalize switches to FULL_STATE_DICT for the final save
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        # checkpointing is set on the model (model.prepare_for_training), not by FSDP a second time
        "fsdp_activation_checkpointing": False,
    }
    if version == 2:
        # each layer reshards after its forward (FULL_SHARD); the root stays gathered (torch _fsdp_state.py)
        return {**common, "fsdp_reshard_after_forward": True}
    return {
        **common,
        # FSDP1: transformers' Trainer applies peft's LoRA wrap policy and the 4-bit storage dtype only on the
        # FSDP1 path (trainer.py _prepare_for_training → distributed/fsdp.py update_fsdp_plugin_peft).
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_forward_prefetch": False,
        "fsdp_sync_module_states": True,  # needed by cpu_ram_efficient_loading on FSDP1
        # peft's FSDP-QLoRA config keeps flat parameters (use_orig_params false): its wrap policy gives the
        # trainable LoRA leaves their own units, so no flat parameter mixes frozen and trainable weights.
        "fsdp_use_orig_params": recipe.adapter.kind != "lora",
    }


def launcher() -> list[str]:
    """`accelerate` next to this Python (the venv's), else the module form."""
    script = Path(sys.executable).parent / "accelerate"
    return [str(script), "launch"] if script.is_file() else [sys.executable, "-m", "accelerate.commands.launch"]


def launch_command(
    run: RunDir, plan: LaunchPlan, trust_remote_code: bool = False, reward_fns: tuple[str, ...] = ()
) -> list[str]:
    """The ranks' command line. --trust-remote-code and GRPO's --reward-fn travel here, never through the run
    directory's recipe.yaml, which cannot grant running code (`lowmem_ft.recipe.load`)."""
    return [
        *launcher(),
        "--config_file",
        str(run.accelerate_file),
        *plan.accelerate_args,
        "-m",
        "lowmem_ft",
        "train",
        "--run-dir",
        str(run.path),
        *(["--trust-remote-code"] if trust_remote_code else []),
        *(arg for entry in reward_fns for arg in ("--reward-fn", entry)),
    ]


def prepare(
    run: RunDir, recipe: Recipe, plan: LaunchPlan, choice: Choice, resume: bool, reward_fns: tuple[str, ...] = ()
) -> list[str]:
    """Write recipe.yaml, accelerate.yaml and launch.json into the run directory; return the launch command."""
    layer_cls = layer_class(recipe) if plan.strategy == "fsdp" else None
    config = accelerate_config(recipe, plan, layer_cls)
    run.write_recipe(recipe)
    header = (
        f"# accelerate config of run {run.name}: {plan.strategy} on {plan.world_size} process(es)"
        + (" (CPU, gloo)" if plan.cpu else "")
        + "\n"
    )
    cmd = launch_command(run, plan, recipe.model.trust_remote_code, reward_fns)
    info = {"plan": plan.to_dict(), "choice": choice.to_dict(), "resume": resume, "command": shlex.join(cmd)}
    run.write_launch(header + yaml.safe_dump(config, sort_keys=False), info)
    return cmd


def run(cmd: list[str]) -> int:
    """Run `accelerate launch`; its processes print their own progress.

    accelerate (torchrun's agent) runs in a session of its own, so a signal reaches it once, from here: a terminal's
    Ctrl-C or a SIGINT / SIGTERM / SIGHUP sent to this process is passed on, and the agent passes it to every rank, which
    finishes its step, saves a checkpoint and exits (`lowmem_ft.train.resilience.interrupt`) while this process waits. A second
    Ctrl-C a second later stops waiting (the agent gets SIGTERM). Should this process die without a word (kill -9),
    the kernel sends the agent SIGTERM (`PR_SET_PDEATHSIG`): the ranks stop the same way, not orphaned. A rank that
    dies or hangs ends the launch too: torchrun stops the others when one exits, and a rank waiting for a hung one
    fails after training.rank_timeout_s (`settle` says which rank and why).
    """
    env = dict(os.environ)
    # the children import this checkout of lowmem_ft, wherever they start
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    process = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    first: list[float] = []

    def on_sigint(signum, frame):
        if first and time.monotonic() - first[0] >= 1.0:
            process.send_signal(signal.SIGTERM)
            raise KeyboardInterrupt
        if not first:
            process.send_signal(signal.SIGINT)
        first[:] = first or [time.monotonic()]

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, on_sigint),
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signum)),
        # a closed terminal or SSH session: torchrun's agent passes SIGHUP on to the ranks as it does SIGTERM
        signal.SIGHUP: signal.signal(signal.SIGHUP, lambda signum, frame: process.send_signal(signum)),
    }
    try:
        return process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _die_with_parent() -> None:
    """In the launched child, before it runs: SIGTERM when the launching process dies (Linux prctl)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def settle(run: RunDir, plan: LaunchPlan, code: int) -> None:
    """After a launch that did not end well (`code` != 0): record in run.json how it ended — which rank ended it and
    why, from each rank's own status — and raise it as one line (`Interrupted` for an interrupt).

    A rank that ended with its own error is the cause (the first such, by time); the others then lost it at a
    collective. A rank that recorded no end was killed (kill -9, the host's OOM killer) — or hung, when another
    rank timed out waiting for it, and the launch stopped it."""
    from lowmem_ft.errors import Interrupted
    from lowmem_ft.rundir import RunStatus

    if code == 0:
        return
    statuses = run.rank_statuses(plan.world_size)
    state, rank, why, signame = how_it_ended(statuses, run.read_recipe().training.rank_timeout_s)
    kept = run.last_checkpoint()
    reason = f"{why}; {run.continuation()}"
    before = statuses[0] or RunStatus("running")
    run.write_status(
        before.ended(state, rank=rank, reason=reason, signal=signame, checkpoint=str(kept) if kept else None)
    )
    if state == "interrupted":
        raise Interrupted(reason, getattr(signal, signame or "SIGINT"))
    raise UserError(reason)


def how_it_ended(statuses: dict[int, Any], timeout_s: int) -> tuple[str, int | None, str, str | None]:
    """(state, the rank that ended the launch, why, the signal of an interrupt) from each rank's last status."""
    failed = {r: s for r, s in statuses.items() if s is not None and s.state == "failed"}
    own = {r: s for r, s in failed.items() if "lost the other ranks" not in (s.reason or "")}
    silent = sorted(r for r, s in statuses.items() if s is None or s.state == "running")
    if own:
        rank = min(own, key=lambda r: (own[r].ended_at or "", r))
        first = (own[rank].reason or "").split("; kept ")[0].split("; no checkpoint kept")[0]
        during = f" during step {own[rank].step + 1}" if own[rank].step is not None else " before training"
        return "failed", rank, f"rank {rank} failed{during}: {first}", None
    if silent:
        rank = silent[0]
        waited = [s for s in failed.values() if "Timed out" in (s.reason or "") or "timeout" in (s.reason or "")]
        if waited:
            if all(s.step is None for s in waited):  # still building: the build wait (`ranks.building`)
                from lowmem_ft.train.distributed.ranks import SETUP_TIMEOUT_S

                how_long = f"{max(timeout_s, SETUP_TIMEOUT_S)} s for it while the ranks were being built"
            else:
                how_long = f"{timeout_s} s for it at a collective (training.rank_timeout_s)"
            return (
                "failed",
                rank,
                f"rank {rank} stopped responding: the other ranks waited {how_long}, then the launch stopped it",
                None,
            )
        return "failed", rank, f"rank {rank} ended without a word (killed, or out of host memory)", None
    interrupted = {r: s for r, s in statuses.items() if s is not None and s.state == "interrupted"}
    if interrupted:
        rank = min(interrupted)
        s = interrupted[rank]
        return (
            "interrupted",
            rank,
            (s.reason or "interrupted").split("; kept ")[0].split("; no checkpoint")[0],
            s.signal,
        )
    if failed:
        rank = min(failed)
        return "failed", rank, (failed[rank].reason or "").split("; kept ")[0], None
    return "failed", None, "the launch ended before any rank started training", None
