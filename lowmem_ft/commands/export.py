"""`lowmem-ft export RUN_DIR --to gguf [--quant f16|bf16|q8_0|q4_k_m|…] [--output FILE] [--ollama]`: one GGUF file.

The adapter is merged into the base tensor by tensor as the file is written (`lowmem_ft.export`), so the export
needs a block of weights in host memory, not the 16-bit model that `merge` loads; the plan (host memory, disk) is
printed first and the export refused in one line when it does not fit. The file appears whole or not at all.
K-quants go through llama.cpp's own quantizer on an f16 file written first (`lowmem_ft.export.llama_quant`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowmem_ft.commands import flags
from lowmem_ft.errors import UserError

GB = 1e9


def add_parser(sub) -> None:
    from lowmem_ft.export.gguf_file import QUANTS
    from lowmem_ft.export.llama_quant import LLAMA_QUANTS

    p = sub.add_parser(
        "export",
        help="export a run (adapter merged into its base, or a full fine-tune) to one GGUF file for llama.cpp / Ollama",
        description="Merge RUN_DIR's adapter into its base tensor by tensor while writing a GGUF file (no 16-bit "
        "model in memory): architecture metadata, the tokenizer and chat template, the weights in --quant.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `lowmem-ft train` (runs/<name>)")
    p.add_argument("--to", choices=["gguf"], default="gguf", help="the format (gguf)")
    p.add_argument(
        "--quant",
        choices=[*QUANTS, *LLAMA_QUANTS],
        default="q8_0",
        help="weight type: f16 / bf16 (lossless from 16-bit training), q8_0 (half the size, llama.cpp's 8-bit); "
        "K-quants (q4_k_m, …) through llama.cpp's quantizer, from the gguf-quants extra (default q8_0)",
    )
    p.add_argument("--output", metavar="FILE", help="the .gguf file to write (default RUN_DIR/<run>-<quant>.gguf)")
    p.add_argument("--ollama", action="store_true", help="also write a Modelfile beside it and print `ollama create`")
    p.add_argument("--base", metavar="PATH", help="the base model, if it is no longer where training found it")
    p.add_argument(
        "--host-ram",
        type=flags.ranged(float, gt=0, unit=" GB"),
        metavar="GB",
        help="host memory the export may use (default: what the machine has available now)",
    )
    p.set_defaults(func=run)


def _local_dir(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # offline and not cached, or no such repo
        raise UserError(f"base model {name_or_path}: not a local directory and not downloadable ({exc}); "
                        f"pass --base PATH") from None  # fmt: skip


def _output(args: argparse.Namespace, run_dir: Path) -> Path:
    """The file to write: named *.gguf, not there yet, in a writable directory."""
    from lowmem_ft.checks import check_writable

    output = Path(args.output) if args.output else run_dir / f"{run_dir.name}-{args.quant}.gguf"
    if output.suffix != ".gguf":
        raise UserError(f"--output {output}: name the file *.gguf")
    if output.is_dir():
        raise UserError(f"--output {output} is a directory; name the .gguf file to write")
    if output.exists():
        raise UserError(f"--output {output} exists; remove it or pick another name")
    check_writable(output.parent, "--output")
    return output


def _config(model_dir: Path):
    from lowmem_ft.export.gguf_file import model_config

    try:
        return model_config(model_dir)
    except (ValueError, OSError) as exc:  # a model_type transformers does not know (remote code), a broken config
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{model_dir}: its config does not load ({first}); GGUF export maps the families "
                        f"transformers itself knows") from None  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from lowmem_ft.export import llama_quant
    from lowmem_ft.export.gguf_file import QUANTS, nbytes, plan_tensors
    from lowmem_ft.export.plan import check_fits, free_disk, make_plan
    from lowmem_ft.finetuned import open_run
    from lowmem_ft.memory.inference import human

    k_quant = args.quant in llama_quant.LLAMA_QUANTS
    if k_quant:
        llama_quant.require(args.quant)
    _require("gguf", "the GGUF writer")
    run_ = open_run(args.run_dir, base=args.base)
    model_dir = run_.weights_dir if run_.full else _local_dir(run_.base)
    output = _output(args, run_.run_dir)
    config = _config(model_dir)
    written = "f16" if k_quant else args.quant  # what lowmem-ft writes; llama.cpp quantizes the f16 file
    planned = plan_tensors(model_dir, config, written)  # refuses an unmapped family in one line
    adapter_bytes = 0 if run_.full else (run_.weights_dir / "adapter_model.safetensors").stat().st_size
    # a K-quant: the f16 file and llama.cpp's output, bounded by its Q8_0 size (llama_quant's docstring)
    plan = (llama_quant.make_plan if k_quant else make_plan)(planned, args.quant, adapter_bytes, config)
    if args.host_ram is not None:
        budget, host_from = int(args.host_ram * GB), f"--host-ram {args.host_ram:g}"
    else:
        from lowmem_ft.merging import available_host_bytes

        budget, host_from = available_host_bytes(), "this machine's available memory"
    others = {q: sum(nbytes(p.ref.shape, _qtype_of(p, q)) for p in planned) for q in QUANTS if q != args.quant}
    check_fits(plan, budget, host_from, free_disk(output), output, others)  # before any weight is read

    what = "full fine-tune" if run_.full else f"base {run_.base} + adapter {run_.weights_dir}"
    print(f"export plan: {what} → {output} ({args.quant}, {config.model_type}, {plan.params:,} params)")
    print(f"  host memory {human(plan.host)} ({plan.describe()}; merged block by block, never the whole model)")
    if k_quant:
        print(f"  disk {human(plan.intermediate_bytes)} for the f16 file llama.cpp quantizes + at most "
              f"{human(plan.tensor_bytes)} for the {args.quant} file (its Q8_0 size), + metadata; renamed when done")  # fmt: skip
    else:
        print(f"  disk {human(plan.tensor_bytes)} of weights + metadata, written under a hidden name and renamed")
    from lowmem_ft.export import text_decoder

    decoder = text_decoder.of(model_dir)
    if decoder is not None:  # a VLM: its text decoder alone, as llama.cpp's converter writes it
        print(f"  note: the {decoder.model_type} checkpoint's text decoder is exported; {decoder.note}")
        from lowmem_ft.export.stream import left_out

        tower = 0 if run_.full else left_out(run_.weights_dir / "adapter_model.safetensors", decoder.name)
        if tower:
            print(f"  note: the adapter's {tower} tensors on the vision tower / projector are left out with them")
    trained = run_.recipe.model.quantization
    if not run_.full and trained != "none":
        print(f"  note: the adapter learned against {trained}-rounded weights and is merged into the base's 16-bit "
              f"originals (the usual QLoRA export, as `lowmem-ft merge` does)")  # fmt: skip

    from lowmem_ft.export.gguf_file import clear_dead_partials, write_gguf

    clear_dead_partials(output)
    bar = _progress(len(planned))
    adapter_dir = None if run_.full else run_.weights_dir

    def write(path: Path, quant: str) -> None:
        write_gguf(model_dir, adapter_dir, run_.weights_dir, path, quant, run_.run_dir.name, progress=bar)

    if k_quant:
        llama_quant.write_quantized(lambda path: write(path, "f16"), output, args.quant,
                                    on_quantize=lambda: print(f"quantizing to {args.quant} with llama.cpp"))  # fmt: skip
    else:
        write(output, args.quant)
    print(f"wrote {output} ({human(output.stat().st_size)})")
    if args.ollama:
        from lowmem_ft.export.ollama import stop_tokens, write_modelfile
        from lowmem_ft.finetuned import load_tokenizer_of

        stops = stop_tokens(model_dir, load_tokenizer_of(run_))
        modelfile = write_modelfile(output, stops, run_.recipe.memory.max_seq_len)
        print(f"wrote {modelfile} (stop tokens: {', '.join(stops)})")
        print(f"  ollama create {run_.run_dir.name} -f {modelfile}")
    return 0


def _qtype_of(p, quant: str) -> str:
    from lowmem_ft.export.gguf_file import tensor_qtype

    return tensor_qtype(p.ref.shape, quant)


def _require(module: str, what: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UserError(f"{what} needs the `{module}` package: pip install {module} (or bash scripts/setup.sh)")


def _progress(total: int):
    from lowmem_ft import console

    if console.quiet():
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="writing tensors", unit="tensor", leave=False)

    def update(done: int, _total: int) -> None:
        bar.update(done - bar.n)
        if done == _total:
            bar.close()

    return update
