"""The model zoo built once on disk for every test session and xdist worker: `.lowmem-cache/zoo/<key>/`.

Each xdist worker is a session of its own, so each built the whole zoo (`devkit.zoo.build_all`: 11 models, each with
a tokenizer trained on the spot) — 9.8 s of CPU, 41 s of wall time on the shared 2-core machine (load average 10),
measured with `time` around `build_all` — and so did every fast-tier run. Here the first worker builds it into a
staging directory under a lock and renames it when complete; the others, and later sessions, wait for the lock and
copy it. The key is a digest of the code that builds the zoo and of the library versions that write it, so editing
`devkit/zoo.py` (a new family) or a new transformers builds it again; `LOWMEM_FT_TEST_CACHE` moves the cache, and
`LOWMEM_FT_TEST_CACHE=off` builds in the session as before.

Each session works on its own copy (a test may write into a model's directory), made in well under a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the zoo's bytes depend on: the code that builds it and the libraries that write it.
SOURCES = (
    "devkit/zoo.py",
    "devkit/tiny.py",
    "devkit/qwen_v1.py",
    "lowmem_ft/data/templates.py",
    "lowmem_ft/native/qwen_v1.py",
)
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "huggingface-hub")


def cache_root() -> Path | None:
    where = os.environ.get("LOWMEM_FT_TEST_CACHE", str(ROOT / ".lowmem-cache"))
    return None if where == "off" else Path(where)


def key() -> str:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.encode() + b"\0" + (ROOT / source).read_bytes() + b"\0")
    for name in LIBRARIES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{name}=={version}\0".encode())
    return digest.hexdigest()[:16]


def zoo(dest: Path) -> dict[str, Path]:
    """Every zoo family under `dest/<name>`, copied from the on-disk cache (built there first if needed)."""
    from devkit.zoo import NAMES, build_all

    root = cache_root()
    if root is None:
        return build_all(dest)
    cached = root / "zoo" / key()
    if not cached.is_dir():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with open(cached.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building it: wait, then look again
            if not cached.is_dir():
                staging = cached.parent / f".staging-{os.getpid()}"
                shutil.rmtree(staging, ignore_errors=True)
                build_all(staging)
                staging.rename(cached)  # complete or absent: a build cut short is never taken for the zoo
    shutil.copytree(cached, dest, dirs_exist_ok=True)
    return {name: dest / name for name in NAMES}
