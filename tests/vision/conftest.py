"""The tiny vision-language checkpoints (built once per session) and image-chat data in the shape users bring: a JSONL
file with `messages` + `images`, the images in a folder beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RED, GREEN = (64, 48), (100, 60)  # pixel sizes: 2×2 and 2×4 merged tokens after smart_resize to multiples of 28
ROWS = [
    {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]},
        ],
        "images": ["img/red.png"],
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]},
            {"role": "assistant", "content": "Red and green."},
            {"role": "user", "content": "Which is wider?"},
            {"role": "assistant", "content": "The green one."},
        ],
        "images": ["img/red.png", "img/green.jpg"],
    },
    {
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "text", "text": "Colour?"}, {"type": "image"}]},
            {"role": "assistant", "content": "Green."},
        ],
        "images": ["img/green.jpg"],
    },
]


@pytest.fixture(scope="session")
def qwen_vl(tmp_path_factory) -> str:
    from devkit.zoo import build

    return str(build("qwen2.5-vl", tmp_path_factory.mktemp("zoo") / "qwen2.5-vl"))


@pytest.fixture(scope="session")
def gemma3_vl(tmp_path_factory) -> str:
    from devkit.zoo import build

    return str(build("gemma3-vision", tmp_path_factory.mktemp("zoo") / "gemma3-vision"))


@pytest.fixture(scope="session")
def vision_zoo(zoo_models) -> Path:
    """This session's copy of the zoo (tests/zoo_cache.py builds the vision families beside the text ones)."""
    return Path(next(iter(zoo_models.values()))).parent


@pytest.fixture(scope="session")
def smolvlm(vision_zoo) -> str:
    """SmolVLM-Instruct's layout (model_type idefics3)."""
    return str(vision_zoo / "smolvlm")


@pytest.fixture(scope="session")
def smolvlm2(vision_zoo) -> str:
    """SmolVLM2's layout (model_type smolvlm)."""
    return str(vision_zoo / "smolvlm2")


@pytest.fixture(scope="session")
def llava_onevision(vision_zoo) -> str:
    """llava-onevision-qwen2's layout (model_type llava_onevision), anyres grids up to 3 × 3 crops."""
    return str(vision_zoo / "llava-onevision")


@pytest.fixture(scope="session")
def llava(vision_zoo) -> str:
    """llava-1.5-7b-hf's layout (model_type llava)."""
    return str(vision_zoo / "llava")


def write_images(folder: Path) -> None:
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", RED, (200, 10, 10)).save(folder / "img" / "red.png")
    Image.new("RGB", GREEN, (10, 200, 10)).save(folder / "img" / "green.jpg")


def write_rows(folder: Path, rows: list[dict], name: str = "vlm.jsonl", repeat: int = 1) -> Path:
    write_images(folder)
    path = folder / name
    path.write_text("\n".join(json.dumps(r) for r in rows * repeat) + "\n")
    return path


def adapter_keys(run: Path) -> list[str]:
    """The names of the tensors a run's adapter saved."""
    from safetensors import safe_open

    with safe_open(run / "adapter" / "adapter_model.safetensors", "pt") as saved:
        return list(saved.keys())


def phases_within_prediction(run: Path) -> dict[str, list[dict]]:
    """A run's memory samples of the forward, backward and optimizer phases that carry a prediction, by phase; each
    phase must have run, and its measured peak be within MEMORY_TOLERANCE of what was predicted for it."""
    from tests.train.tiny_runs import MEMORY_TOLERANCE

    phases: dict[str, list[dict]] = {}
    for s in map(json.loads, (run / "memory.jsonl").read_text().splitlines()):
        if s.get("phase") in ("forward", "backward", "optimizer") and s.get("predicted_peak_live_gb"):
            phases.setdefault(s["phase"], []).append(s)
    assert set(phases) == {"forward", "backward", "optimizer"}, set(phases)
    for phase, points in phases.items():
        peak = max(points, key=lambda s: s["peak_live_gb"])
        assert abs(peak["peak_live_gb"] / peak["predicted_peak_live_gb"] - 1) <= MEMORY_TOLERANCE, (phase, peak)
    return phases


@pytest.fixture
def vlm_data(tmp_path) -> Path:
    return write_rows(tmp_path, ROWS)
