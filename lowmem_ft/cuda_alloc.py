"""Which setting of PyTorch's CUDA caching allocator a run uses: the one decision `train` acts on
(`lowmem_ft.train.device.configure_allocator`) and `plan` prices (`lowmem_ft.memory.overheads`).

torch reads `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`, once, when the caching allocator initialises
(c10/cuda/CUDAAllocatorConfig.h `instance()`; comma-separated `key:value` options, c10/core/AllocatorConfig.h).
`train` sets `expandable_segments:True` unless the user set either variable, so a plan made in the same
environment as the run prices the same allocator: expandable segments by default, torch's default settings when the
user's variable leaves them off (a plain `Trainer` run, or `PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128`).
No torch here: `plan` reads the environment, not the device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lowmem_ft.memory.records import AllocatorSetting

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"  # read first by torch's CUDA allocator
ALLOC_CONF_GENERIC = "PYTORCH_ALLOC_CONF"  # read when the first is unset (torch ≥ 2.9's name for every device)
# Expandable segments let the caching allocator grow a segment in place instead of leaving differently sized
# blocks stranded between steps of varying sequence length (torch docs, "Optimizing memory usage with
# PYTORCH_CUDA_ALLOC_CONF"); it is read when the allocator initialises, so it must be set before CUDA is first used.
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def user_alloc_conf(environ: Mapping[str, str] | None = None) -> str | None:
    """The allocator settings the user gave (the variable torch reads first), or None."""
    env = os.environ if environ is None else environ
    for name in (ALLOC_CONF, ALLOC_CONF_GENERIC):
        if name in env:
            return env[name]
    return None


def alloc_conf(environ: Mapping[str, str] | None = None) -> str:
    """The settings a `train` run started in this environment gives the allocator: the user's, else ours."""
    conf = user_alloc_conf(environ)
    return DEFAULT_ALLOC_CONF if conf is None else conf


def setting_of(conf: str) -> AllocatorSetting:
    """ "expandable segments" when `conf` turns them on (`expandable_segments:True`; torch's parser takes
    True/False), else "default"."""
    for option in conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments" and value.strip().lower() == "true":
            return "expandable segments"
    return "default"


def run_setting(environ: Mapping[str, str] | None = None) -> AllocatorSetting:
    """The allocator setting of a `train` run started in this environment (what `plan` prices)."""
    return setting_of(alloc_conf(environ))
