"""Build the embedded tiny Qwen2 model and tokenizer (deterministic, no network).

python scripts/build_tiny_model.py [--out models/tiny-qwen2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowmem_ft.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "models" / "tiny-qwen2"))
    args = parser.parse_args()
    print(f"wrote {build_tiny_model(args.out)}")
