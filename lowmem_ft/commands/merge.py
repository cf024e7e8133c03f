"""`lowmem-ft merge RUN_DIR --output DIR`: fold the LoRA adapter into the base and save a standalone model.

The one memory trap: a QLoRA base is 4-bit, and merging into 4-bit weights would round the adapter's update
away (and not load without bitsandbytes). So the base is always reloaded in 16-bit for the merge — params × 2
bytes, which can be several times what training held. `lowmem_ft.merging` plans what each step holds before any
weight is read: on the GPU when it fits, else on the host, else one line saying what it needs. The output appears
whole (staged beside it, renamed when complete) or not at all.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from lowmem_ft.checks import check_writable
from lowmem_ft.commands import flags
from lowmem_ft.errors import UserError
from lowmem_ft.memory.estimate import DTYPE_BYTES
from lowmem_ft.merging import MergePlan, choose, largest_adapted_linear, staged_output


def add_parser(sub) -> None:
    p = sub.add_parser(
        "merge",
        help="merge a run's LoRA adapter into its base and save a standalone model",
        description="Reload RUN_DIR's base in 16-bit (never into 4-bit weights), merge the adapter, and save "
        "safetensors shards + tokenizer to --output: a model transformers loads without peft.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `lowmem-ft train` (runs/<name>)")
    p.add_argument("--output", required=True, metavar="DIR", help="where to save the merged model (new or empty)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to merge; auto uses the GPU when the 16-bit base fits in its free memory, else the CPU",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES),
        help="dtype of the merged weights (default: the recipe's model.compute_dtype)",
    )
    p.add_argument("--base", metavar="PATH", help="the base model, if it is no longer where training found it")
    p.add_argument(
        "--max-shard-size", type=flags.shard_size, default="5GB", help="largest safetensors shard (default 5GB)"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the base model's (or tokenizer's) own code; the run directory's recipe cannot turn this on",
    )
    flags.add_push_to_hub(p, "the merged model", "when the merge is done")
    p.set_defaults(func=run)


def base_on_meta(recipe):
    """The base built from its config on the meta device: no weight is read or allocated."""
    from accelerate import init_empty_weights

    from lowmem_ft.train.model import auto_class, load_config

    config = load_config(recipe)
    with init_empty_weights():  # AutoModelForImageTextToText for an image run's base (Qwen2.5-VL)
        return auto_class(config).from_config(config, trust_remote_code=recipe.model.trust_remote_code)


def count_parameters(recipe) -> int:
    """Parameters of the base from its config alone."""
    return sum(p.numel() for p in base_on_meta(recipe).parameters())


def check_output(output: Path, run_dir: Path) -> None:
    """--output before the merge starts: not inside the run directory's checkpoints or weights, a new or empty
    directory, and writable (`lowmem_ft.checks.check_writable`)."""
    where = output.resolve()
    for inside in ("checkpoints", "adapter", "model"):
        if where.is_relative_to((run_dir / inside).resolve()):
            raise UserError(f"--output {output} is inside the run's {inside}/; pick a directory outside it")
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file; pick a new directory")
    if output.is_dir() and any(output.iterdir()):
        raise UserError(f"--output {output} exists and is not empty; pick a new directory")
    check_writable(output, "--output")


def check_space(output: Path, needed: int) -> None:
    """The disk under --output holds the merged weights (what save_pretrained writes, tokenizer aside)."""
    from lowmem_ft.memory.inference import human

    probe = output.resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise UserError(
            f"--output {output}: the merged model needs {human(needed)} but the disk has {human(free)} free"
        )


def run(args: argparse.Namespace) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    from lowmem_ft.finetuned import load_finetuned, load_tokenizer_of, open_run
    from lowmem_ft.memory.inference import human

    output = Path(args.output)
    hub_repo = None
    if args.push_to_hub:  # before any weight is read: an upload that cannot happen fails now
        from lowmem_ft.hub import preflight

        hub_repo = preflight(args.push_to_hub, private=args.hub_private)
    run_ = open_run(args.run_dir, base=args.base, trust_remote_code=args.trust_remote_code)
    if run_.full:
        raise UserError(
            f"{args.run_dir} is a full fine-tune: {run_.weights_dir} already is a standalone model; load it directly"
        )
    check_output(output, run_.run_dir)

    trained = run_.recipe.model
    dtype = args.dtype or trained.compute_dtype
    recipe = run_.base_recipe(quantization="none", compute_dtype=dtype)
    meta = base_on_meta(recipe)
    plan = MergePlan(
        params=sum(p.numel() for p in meta.parameters()),
        dtype_bytes=DTYPE_BYTES[dtype],
        adapter=(run_.weights_dir / "adapter_model.safetensors").stat().st_size,
        largest_linear=largest_adapted_linear(meta, run_.recipe.adapter.target_modules),
        shard=convert_file_size_to_int(args.max_shard_size),
    )
    del meta
    check_space(output, plan.weights)
    device, why = choose(plan, args.device)  # refuses here, before any weight is read, when nothing fits
    device_bytes, host_bytes = plan.needs(device)
    storage = f"trained on {trained.quantization}, reloaded in {dtype}" if trained.quantization != "none" else dtype
    print(f"merge plan: base {run_.base} ({plan.params:,} params, {storage}) = {human(plan.weights)} + adapter "
          f"{human(plan.adapter)}")  # fmt: skip
    if device == "cuda":
        print(f"  device memory {human(device_bytes)} ({plan.describe()}); host memory {human(host_bytes)}: one "
              f"shard (--max-shard-size {args.max_shard_size}) while saving")  # fmt: skip
    else:
        print(f"  on the CPU ({why}): host memory {human(host_bytes)} ({plan.describe()}), no device memory")
    if trained.quantization != "none":
        print(
            f"  note: the adapter learned against {trained.quantization}-rounded weights and is merged into the "
            f"{dtype} originals (the usual QLoRA export); compare outputs with `lowmem-ft generate`"
        )

    model = load_finetuned(run_, recipe, device)
    merged = model.merge_and_unload(safe_merge=True)
    with staged_output(output) as staged:  # renamed to --output once weights, tokenizer and card are all there
        merged.save_pretrained(staged, max_shard_size=args.max_shard_size)
        load_tokenizer_of(run_).save_pretrained(staged)
        for name in ("preprocessor_config.json", "processor_config.json"):  # an image run's, at its trained cap
            if (run_.weights_dir / name).is_file():
                shutil.copy2(run_.weights_dir / name, staged / name)
        _card(run_.run_dir, output, staged, hub_repo)
    shards = sorted(p.name for p in output.glob("*.safetensors"))
    print(
        f"merged model saved to {output} ({len(shards)} safetensors shard{'s' if len(shards) != 1 else ''} + tokenizer)"
    )
    auto = "AutoModelForImageTextToText" if (output / "preprocessor_config.json").is_file() else "AutoModelForCausalLM"
    print(f"  load it with {auto}.from_pretrained({str(output)!r}) — no peft needed", file=sys.stdout)
    if hub_repo is not None:
        from lowmem_ft.hub import push

        print(f"pushed to {push(output, hub_repo, what=f'merged model of run {run_.run_dir.name}')}")
    return 0


def _card(run_dir: Path, output: Path, staged: Path, hub_repo) -> None:
    """The merged model's card (README.md: the training run's recipe, plan and measured peak), written into the
    staging directory with the usage example loading `output`, where it is renamed to."""
    from lowmem_ft.hub import CARD, model_card
    from lowmem_ft.rundir import RunDir

    model_card(RunDir(run_dir), repo_id=hub_repo.repo_id if hub_repo else "", merged=True, folder=output).save(
        staged / CARD
    )
