"""`lowmem-ft eval RUN_OR_MODEL --tasks NAME,…|FILE.yaml [--limit N] [--compare-base]`: lm-eval on the fine-tune.

The run is evaluated as trained — the adapter on its base stored as in training, no merge — and with
`--compare-base` the same loaded model with its adapter switched off (peft's `disable_adapter`: no second copy of
the base). The batch size is planned from the memory model within `--vram` (`lowmem_ft.evaluate.batch`), never
found by running into OOM. Scores go to `eval.json` in the run directory and to the run's trackers
(`lowmem_ft.evaluate.trackers`), and print as a table with the deltas.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from lowmem_ft.commands import flags
from lowmem_ft.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a run (adapter on its base) or a model with lm-eval; --compare-base adds the base's scores",
        description="Run lm-eval tasks on RUN_OR_MODEL: a run directory (its adapter on its base, as trained) or "
        "a model directory. Task names, or your own task .yaml files (lm-eval's format) over local data.",
    )
    p.add_argument("target", metavar="RUN_OR_MODEL", help="a run directory (runs/<name>) or a model directory")
    p.add_argument("--tasks", required=True, metavar="NAME,…|FILE.yaml", help="lm-eval task names or task files")
    p.add_argument("--limit", type=flags.count, metavar="N", help="at most N examples per task (a quick look)")
    p.add_argument("--compare-base", action="store_true", help="also evaluate the base model and print the deltas")
    p.add_argument("--vram", type=flags.vram_gb, metavar="GB", help="GPU memory to fit in (default: the whole GPU)")
    p.add_argument("--max-length", type=flags.count, metavar="TOKENS",
                   help="longest context (default: the run's memory.max_seq_len, else the model's)")  # fmt: skip
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (default auto)")
    p.add_argument("--include-path", metavar="DIR", help="a directory of extra task .yaml files (lm-eval's flag)")
    p.add_argument("--base", metavar="PATH", help="the base model, if it is no longer where training found it")
    p.set_defaults(func=run)


def _require_lm_eval() -> None:
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise UserError("eval needs lm-eval: pip install 'lm-eval==0.4.13' (or bash scripts/setup.sh)")


def _load(args, device: str):
    """(model, tokenizer, run or None, max_length default)."""
    target = Path(args.target)
    if (target / "recipe.yaml").is_file():
        from lowmem_ft.finetuned import load_finetuned, load_tokenizer_of, open_run

        run = open_run(target, base=args.base)
        return (
            load_finetuned(run, run.base_recipe(), device),
            load_tokenizer_of(run),
            run,
            run.recipe.memory.max_seq_len,
        )
    if args.compare_base:
        raise UserError(f"--compare-base needs a run directory; {target} is a model (evaluate its base separately)")
    from lowmem_ft.checks import check_model

    check_model(args.target, "RUN_OR_MODEL")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device)
    return model, AutoTokenizer.from_pretrained(args.target), None, None


def _batch(args, model, run, device: str, max_length: int) -> int:
    from lowmem_ft.commands.generate import _budget_bytes, reserve_bytes
    from lowmem_ft.evaluate.batch import plan_batch
    from lowmem_ft.finetuned import weights_bytes
    from lowmem_ft.memory.arch import Architecture

    budget = _budget_bytes(args, device)
    if budget is None:
        print("eval plan: no device budget on the CPU (no --vram): batch 1", file=sys.stderr)
        return 1
    margin = run.recipe.memory.safety_margin_gb if run is not None else 1.0
    arch = Architecture.from_config(model.config.to_dict(), name=args.target)
    bytes_per_value = next(p for p in model.parameters() if p.is_floating_point()).element_size()
    plan = plan_batch(arch, budget=budget, weights=weights_bytes(model), reserve=reserve_bytes(margin),
                      max_length=max_length, bytes_per_value=bytes_per_value)  # fmt: skip
    if plan.batch_size < 1:
        given = f"--vram {args.vram:g} GB" if args.vram is not None else "this GPU"
        raise UserError(f"{given} leaves no room for one {max_length}-token eval sequence ({plan.describe()}); "
                        f"raise --vram or lower --max-length")  # fmt: skip
    print(f"eval plan: {plan.describe()}")
    return plan.batch_size


def run(args: argparse.Namespace) -> int:
    _require_lm_eval()
    from lowmem_ft.evaluate.scores import deltas, evaluate
    from lowmem_ft.evaluate.tasks import resolve, task_name
    from lowmem_ft.finetuned import resolve_device

    # an unknown task stops here, before any model loads (`train --eval-tasks` resolved them before training)
    manager, specs = getattr(args, "resolved", None) or resolve(args.tasks, args.include_path)
    names = [task_name(spec) for spec in specs]
    device = resolve_device(args.device)
    model, tokenizer, run_, default_length = _load(args, device)
    model.eval()
    if args.compare_base and run_ is not None and run_.full:
        raise UserError("--compare-base on a full fine-tune: evaluate the base model directory separately")
    max_length = args.max_length or default_length or getattr(model.config, "max_position_embeddings", 2048)
    batch = _batch(args, model, run_, device, max_length)
    print(f"eval: {', '.join(names)} on {args.target} (batch {batch}, max length {max_length}"
          f"{f', limit {args.limit}' if args.limit else ''})")  # fmt: skip
    kwargs = {"batch_size": batch, "max_length": max_length, "limit": args.limit, "device": device}
    tuned = evaluate(model, tokenizer, manager, specs, **kwargs)
    base = None
    if args.compare_base:
        switch = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
        with switch:
            base = evaluate(model, tokenizer, manager, specs, **kwargs)
    _print(tuned, base)
    if run_ is not None:
        record = {"tasks": names, "limit": args.limit, "batch_size": batch, "max_length": max_length,
                  "finetuned": tuned}  # fmt: skip
        if base is not None:
            record |= {"base": base, "delta": deltas(tuned, base)}
        path = run_.run_dir / "eval.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path}")
        from lowmem_ft.evaluate import trackers

        scores = trackers.flat(tuned, base, record.get("delta"))
        sent = trackers.send(run_.recipe, run_.run_dir, scores)
        if sent:
            print(f"scores sent to the run's trackers: {', '.join(sent)}")
    return 0


def _print(tuned: dict, base: dict | None) -> None:
    header = f"{'task':<24} {'metric':<18} {'fine-tuned':>10}"
    if base is not None:
        header += f" {'base':>10} {'delta':>10}"
    print(header)
    for task, row in tuned.items():
        for metric, value in row.items():
            line = f"{task:<24} {metric:<18} {value:>10.4f}"
            if base is not None and metric in base.get(task, {}):
                line += f" {base[task][metric]:>10.4f} {value - base[task][metric]:>+10.4f}"
            print(line)
