"""Build the embedded tiny Qwen2 model and tokenizer (deterministic, no network).

python scripts/build_tiny_model.py [--out models/tiny-qwen2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # devkit/ lives in the checkout, not in the installed package

from devkit.tiny import build_tiny_model  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "models" / "tiny-qwen2"))
    args = parser.parse_args()
    print(f"wrote {build_tiny_model(args.out)}")
