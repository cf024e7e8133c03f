"""The resolution knob of a family whose processor fixes it (Gemma-3's square, LLaVA's crop, LLaVA-OneVision's
pinpoints): one cap, the checkpoint's `max_pixels`, and the family's own sentence (`_how`) for why
`vision.max_pixels` does not apply. The `ImageArithmetic` methods such a family shares."""

from __future__ import annotations

from typing import Any


class FixedResolution:
    """Mixed into a family's image arithmetic that has `max_pixels` and `_how()`."""

    max_pixels: int

    def _how(self) -> str:
        raise NotImplementedError

    def default_cap(self) -> tuple[int, str]:
        return self.max_pixels, self._how()

    def cap_why(self, cap: int) -> str:
        del cap
        return self._how()

    def caps(self, ceiling: int) -> list[int]:
        """One: the resolution is the checkpoint's."""
        del ceiling
        return [self.max_pixels]

    def with_cap(self, config: dict[str, Any], cap: int) -> dict[str, Any]:
        del cap
        return dict(config)

    def at_cap(self, cap: int):
        del cap
        return self
