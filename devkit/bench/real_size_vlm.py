"""The real-size truth table's vision-language rows: `lowmem-ft plan --vram T --model M --data vlm.jsonl --verify`
on the Hub's vision-language checkpoints at full size, traced against predicted per phase.

    python -m devkit.bench.real_size_vlm --out benchmarks/real_size_vlm.md
    python -m devkit.bench.real_size_vlm --models Qwen/Qwen2.5-VL-7B-Instruct --out /tmp/t.md

Each row: the plan `plan --vram T --data` chooses (the resolution cap included) for an image-chat JSONL of photos of
realistic sizes (`write_data`: 640×480 to 1280×960, one and two per sample), its step traced at full size
(`lowmem_ft.train.trace.step`: the model `train` builds, no weights; the image sample the plan priced through the
family's image processor and `train`'s collator) against the memory model's CPU form of the same setup
(`lowmem_ft.train.trace.verify.predict`), every phase.

The checkpoint is a directory made here (`full_size_dir`): the catalog's config.json and preprocessor_config.json of
the Hub model (no weights: planning and tracing read neither) beside the zoo's tokenizer of the family (its chat
template and image tokens, `devkit.zoo`), with the config's image-token ids set to that tokenizer's — the Hub's own
tokenizer is not reachable offline. Image tokens per image are the family's processor arithmetic and do not depend
on the tokenizer; the text tokens around them do (a few dozen per sample).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from lowmem_ft.memory.estimate import GB

# Hub model → the zoo family whose tokenizer stands in for its own
MODELS = {"Qwen/Qwen2.5-VL-7B-Instruct": "qwen2.5-vl", "google/gemma-3-12b-it": "gemma3-vision"}
VRAM = 24.0
# photos: (width, height) of the images of each row (one or two a row)
ROWS = (((640, 480),), ((1280, 960),), ((1024, 768), (800, 600)), ((1280, 960), (960, 1280)))
HEADER = (
    "# Real size: vision-language plans traced\n\n"
    "Written by `python -m devkit.bench.real_size_vlm`. Each row: `lowmem-ft plan --vram T --model M --data "
    "vlm.jsonl --verify` on a JSONL of photos (640×480 to 1280×960, one and two per sample): the plan (with the "
    "resolution cap it chose), its step traced at full size (no weights; the sample the plan priced, through the "
    "family's image processor and `train`'s collator) against the memory model's CPU form per phase (live tensor "
    "bytes, no device overheads). The checkpoint is the catalog's config.json and preprocessor_config.json beside "
    "the zoo's tokenizer of the family (the Hub's is not reachable offline; image tokens do not depend on it). "
    "Below the table: how each was traced and its wall time on a shared 2-core machine.\n\n"
    "| model | vram | plan | images | phase | traced GB | predicted GB | gap |\n"
    "|---|---|---|---|---|---|---|---|\n"
)


def full_size_dir(model: str, family: str, out: Path) -> Path:
    """A checkpoint directory without weights: the catalog's config and preprocessor of `model`, the zoo family's
    tokenizer, the config's image-token ids set to the tokenizer's."""
    from devkit.zoo import FAMILIES, build_tokenizer
    from lowmem_ft.memory.arch import catalog_entry

    entry = catalog_entry(model)
    if entry is None:
        raise SystemExit(f"{model} is not in the catalog")
    config, preprocessor = dict(entry[1]["config"]), entry[1]["preprocessor"]
    tokenizer = build_tokenizer(FAMILIES[family])
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in FAMILIES[family].image_tokens.items()}
    specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    config.update(ids)
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], **specials}
    config.update(specials)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    if "image_seq_length" in preprocessor:  # Gemma-3's processor_config.json, as the Hub ships it
        processor = {"image_seq_length": preprocessor["image_seq_length"], "processor_class": "Gemma3Processor"}
        (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    return out


def write_data(folder: Path) -> Path:
    """An image-chat JSONL of photo-sized images (`ROWS`), the images beside it."""
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, sizes in enumerate(ROWS):
        names = []
        for k, size in enumerate(sizes):
            name = f"img/{i}-{k}.jpg"
            Image.new("RGB", size, (30 + 40 * i, 90 + 30 * k, 160)).save(folder / name)
            names.append(name)
        parts = [{"type": "image"} for _ in names] + [{"type": "text", "text": "What is in the picture?"}]
        lines.append(json.dumps({
            "messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": "A flat picture of one colour, with nothing in it."}],
            "images": names,
        }))  # fmt: skip
    path = folder / "vlm.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(model: str, family: str, work: Path) -> tuple[str, str, object]:
    """(plan, images, verification) of `plan --vram VRAM --data` for `model`."""
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.preparing import TrainRequest, check_plan_inputs, planned
    from lowmem_ft.train.trace.verify import verify
    from lowmem_ft.vision.setup import vision_of

    directory = full_size_dir(model, family, work / family)
    data = write_data(work / "data")
    overrides = {"model": {"name_or_path": str(directory)}, "data": {"path": str(data)}}
    recipe, choice = planned(TrainRequest(overrides=overrides, origins={}, vram_gb=VRAM), check_plan_inputs)
    m = recipe.memory
    quant = "" if recipe.model.quantization == "none" else f"+{recipe.model.quantization}"
    plan = (f"{recipe.adapter.kind}{quant} {recipe.optimizer.name}, {m.micro_batch_size}×{m.max_seq_len}"
            f"{', ckpt' if m.gradient_checkpointing else ''}, tower {recipe.vision.train}")  # fmt: skip
    vision = vision_of(recipe)
    summary = vision.describe(recipe)["data"]["image_tokens_per_sample"]
    images = f"max_pixels {vision.max_pixels:,}; image tokens a sample p50 {summary['p50']}, max {summary['max']}"
    arch = load_architecture(str(directory))
    result = verify(recipe, arch, choice.plan.estimate.peak_bytes)
    return plan, images, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.bench.real_size_vlm", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), help="Hub ids (default: %(default)s)")
    parser.add_argument("--out", default="benchmarks/real_size_vlm.md")
    parser.add_argument("--work", default=None, help="folder for the checkpoint directories and data")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="real-size-vlm-"))
    rows, hows = [], []
    for model in args.models:
        started = time.perf_counter()
        plan, images, v = run(model, MODELS[model], work)
        label = f"| {model} | {VRAM:g} | {plan} | {images} |"
        for phase, t in v.traced.items():
            p = v.predicted[phase]
            rows.append(f"{label} {phase} | {t / GB:.3f} | {p / GB:.3f} | {(p - t) / t:+.2%} |\n")
        rows.append(f"{label} **peak** | {v.traced_peak / GB:.3f} | {v.predicted_peak / GB:.3f} | {v.error:+.2%} |\n")
        hows.append(f"- {model}: {v.how}; trace {v.seconds:.0f} s.\n")
        print(*v.lines(), f"({time.perf_counter() - started:.0f} s with planning)", sep="\n", flush=True)
    Path(args.out).write_text(HEADER + "".join(rows) + "\n" + "".join(hows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
