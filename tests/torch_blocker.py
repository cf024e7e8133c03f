"""A pytest plugin that makes `import torch` fail, as in an environment without torch:
`python -m pytest -p tests.torch_blocker tests/memory/test_estimate.py`. `tests/test_torch_free.py` runs the memory
model's and the recipe's tests under it, so the pure-arithmetic layers stay free of torch and so do their tests."""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder


class _NoTorch(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (tests.torch_blocker)", name=name)
        return None


if any(m == "torch" or m.startswith("torch.") for m in sys.modules):
    raise RuntimeError("tests.torch_blocker: torch was imported before the plugin; load it with -p")
sys.meta_path.insert(0, _NoTorch())
