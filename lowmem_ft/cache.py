"""Where lowmem-ft keeps what it can make again: `$LOWMEM_FT_CACHE`, else `$XDG_CACHE_HOME/lowmem-ft`, else
`~/.cache/lowmem-ft` (the XDG base-directory convention Hugging Face's caches follow too). Tokenized data sets
(`lowmem_ft.data.tokenize`) and GPU calibrations (`lowmem_ft.calibrated`) live under it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """lowmem-ft's cache directory (not created here)."""
    if env := os.environ.get("LOWMEM_FT_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lowmem-ft"
