"""Write the small example dataset `examples/chat.jsonl` deterministically (arithmetic and word questions in chat form).

python -m devkit.example_data [--out examples/chat.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLORS = ["red", "green", "blue", "yellow", "black", "white"]
ANIMALS = ["cat", "dog", "owl", "fox", "bee", "cow"]


def samples(n: int = 96, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        elif i % 3 == 1:
            c, an = rng.choice(COLORS), rng.choice(ANIMALS)
            q, ans = f"Describe a {c} {an}.", f"A {c} {an} is an {an} whose colour is {c}."
        else:
            word = rng.choice(ANIMALS + COLORS)
            q, ans = f"Spell the word {word}.", " ".join(word.upper()) + "."
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": "You are a terse assistant."})
        out.append({"messages": messages})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.example_data", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="examples/chat.jsonl", help="file to write (default: %(default)s)")
    path = Path(parser.parse_args(argv).out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s) + "\n" for s in samples()), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
