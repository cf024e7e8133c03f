"""How long reading image sizes takes: from the header only (what `data stats` and the planner's data profile do)
against decoding every image (what `data stats` did before, and what `train` does once to refuse a truncated file).

python -m devkit.bench.image_reads [--images 200] [--size 2000x1500] [--out benchmarks/image_reads.md]

The images are photos' stand-ins (smooth gradients with noise, so JPEG and PNG compress as photos do), written to a
temporary folder; each read goes through `lowmem_ft.vision.images.image_entry` with its file-identity cache cleared
first, so every image is read again. The end-to-end line runs `lowmem-ft data stats` in-process on a JSONL file of one
image per row with the tiny Qwen2.5-VL zoo checkpoint (its tokenizer and processor numbers).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _write(folder: Path, n: int, width: int, height: int, kind: str) -> list[str]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    base = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2)
    names = []
    for i in range(n):
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        name = f"img{i:04d}.{kind}"
        Image.fromarray(pixels).save(folder / name, quality=90) if kind == "jpg" else Image.fromarray(pixels).save(
            folder / name
        )
        names.append(name)
    return names


def _time(names: list[str], folder: Path, decode: bool) -> float:
    from lowmem_ft.vision import images

    images.forget_sizes()
    started = time.perf_counter()
    for i, name in enumerate(names):
        images.image_entry(name, folder, i, decode)
    return time.perf_counter() - started


def _stats(folder: Path, names: list[str]) -> float:
    from devkit.zoo import build
    from lowmem_ft.cli import main
    from lowmem_ft.vision import images

    model = build("qwen2.5-vl", folder / "qwen2.5-vl")
    row = lambda name: {"messages": [{"role": "user", "content": "<image>Describe it."},  # noqa: E731
                                     {"role": "assistant", "content": "A gradient."}], "images": [name]}  # fmt: skip
    data = folder / "vlm.jsonl"
    data.write_text("".join(json.dumps(row(n)) + "\n" for n in names))
    images.forget_sizes()
    started = time.perf_counter()
    assert main(["data", "stats", str(data), "--model", str(model), "--json"]) == 0
    return time.perf_counter() - started


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.image_reads", description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--size", default="2000x1500")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    width, height = map(int, args.size.split("x"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for kind in ("jpg", "png"):
            names = _write(folder, args.images, width, height, kind)
            mb = sum((folder / n).stat().st_size for n in names) / 1e6
            header, decoded = _time(names, folder, decode=False), _time(names, folder, decode=True)
            line = (f"| {args.images} {kind.upper()} {width}×{height} ({mb:.0f} MB) | {header:.3f} | {decoded:.2f} | "
                    f"{decoded / header:.0f}× |")  # fmt: skip
            rows.append(line)
            print(line, flush=True)
        stats = _stats(folder, names)
        print(f"data stats end to end (PNG, header reads): {stats:.2f} s", flush=True)
    table = "\n".join(["| images | header only, s | decoded, s | ratio |", "| --- | --- | --- | --- |", *rows])
    if args.out:
        note = (
            "Reading the pixel sizes of images, `python -m devkit.bench.image_reads` (one process, the file cache warm "
            "from writing them). Header only: `PIL.Image.open(path).size`, what `data stats` and the planner's data "
            "profile read; decoded: `.load()` as well, what `data stats` did before and `train` does once before "
            f"loading weights.\n\n{table}\n\n`lowmem-ft data stats` end to end on the {args.images} PNG images (one "
            f"per row, the tiny Qwen2.5-VL zoo checkpoint, in-process): {stats:.2f} s.\n"
        )
        Path(args.out).write_text(note, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
