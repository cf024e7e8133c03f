"""Tracing fewer decoder layers than the model has, and extrapolating to all of them.

The decoder layers of one model are copies of one block (or of a repeating run of blocks: Gemma-2's sliding/global
alternation, Gemma-3's five sliding layers and one global, a mixture of experts with a dense layer every k), each
holding the same parameters, adapters, optimizer states and saved activations. Every byte count a step makes —
the peak of each phase and what is live at its end — is then `constant + n × per-period bytes` in the number n of
periods, the constant being everything outside the decoder stack (embeddings, the LM head and its loss, masks,
rotary tables, the loader's batches). So two traces, of n₁ and n₁ + p layers (p the period, n₁ ≡ L mod p), give
the trace of L layers exactly: `f(L) = f(n₁) + (L − n₁) / p · (f(n₁ + p) − f(n₁))`.

What this rests on is checked, not assumed: the layers' signatures (each submodule's class, its plain attributes
other than its own index, its parameters' and buffers' shapes and dtypes) are read from the full model built on the
meta device, the period is the shortest one they repeat with (after a prefix of distinct layers, e.g. DeepSeek's
first dense layers), and the truncated model's layers must carry the first n signatures of the full one; when they
do not, or the model has too few layers for it to save time, the whole model is traced. The equality of extrapolated
and full traces is tested on every zoo family and on mixtures of experts with dense/sparse patterns: one model of
each layer pattern at the depths this module first extrapolates at (`tests/train/trace/test_layers.py`), the others
with `SAVING` set to 0, at the least depth that still extrapolates (`tests/train/trace/test_layers_families.py`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

# A submodule's attributes that name its place in the stack, not what it computes.
_INDEX_ATTRIBUTES = {"layer_idx", "layer_id", "layer_number", "layer_index", "training"}
_PLAIN = (int, float, str, bool, type(None))
# Trace whole unless the two depths together have this many layers fewer than the model: each trace also pays for
# what is outside the stack (the model's build, the embeddings and LM head, the loss), a few layers' worth.
SAVING = 4


@dataclass(frozen=True)
class Layers:
    """Trace `first` and `first + period` decoder layers and extrapolate to `total`."""

    total: int
    first: int
    period: int

    @property
    def traced(self) -> tuple[int, int]:
        return self.first, self.first + self.period

    def extrapolate(self, small: int, large: int) -> int:
        return small + (self.total - self.first) // self.period * (large - small)

    def extrapolate_marks(self, small: Segments, large: Segments) -> dict[str, tuple[int, int]]:
        """label → (peak, live) at `total` layers: each segment's peak extrapolated on its own, then the largest
        (the moment of a phase's peak can move with depth: a full fine-tune's first backward peaks at the LM
        head's backward in a shallow model and at its end, every gradient allocated, in a deep one)."""
        out = {}
        for label, (segs, live) in small.by_label.items():
            other, live2 = large.by_label[label]
            peak = max(self.extrapolate(segs.get(k, 0), other.get(k, 0)) for k in segs.keys() | other.keys())
            out[label] = (peak, self.extrapolate(live, live2))
        return out


def text_config(config):
    return config.get_text_config()


def decoder_layers(model, count: int) -> tuple[str, torch.nn.ModuleList] | None:
    """The model's decoder stack: the `nn.ModuleList` of `count` blocks holding the most parameters, outside any
    vision tower (`lowmem_ft.vision.tower.towers`: a tower's list of as many blocks may hold more, as a tiny
    model's can)."""
    from lowmem_ft.vision.tower import towers

    try:
        beside = tuple(f"{name}." for name in towers(model))
    except (AttributeError, NotImplementedError):
        beside = ()
    found = [
        (sum(p.numel() for p in m.parameters()), name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == count and not f"{name}.".startswith(beside)
    ]
    if not found:
        return None
    _, name, layers = max(found, key=lambda f: f[0])
    return name, layers


def signature(layer: torch.nn.Module) -> tuple:
    """What a decoder block computes and holds, without its index: per submodule, its class, its plain attributes
    (sliding window, attention type, expert counts, ...) and its tensors' shapes and dtypes."""
    out = []
    for name, module in layer.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(module).items()
                if not k.startswith("_") and k not in _INDEX_ATTRIBUTES and isinstance(v, _PLAIN)
            )
        )
        tensors = tuple(
            (n, tuple(t.shape), t.dtype)
            for table in (module._parameters, module._buffers)
            for n, t in table.items()
            if t is not None
        )
        out.append((name, type(module).__name__, attrs, tensors))
    return tuple(out)


def period_of(signatures: list[tuple]) -> tuple[int, int]:
    """(prefix, period): the repetition that needs the fewest layers traced — the signatures from `prefix` on
    repeat every `period` layers, seen at least twice; (0, n) when nothing repeats."""
    ids = [signatures.index(s) for s in signatures]
    n = len(ids)
    best, cost = (0, n), 3 * n
    for period in range(1, n + 1):
        for prefix in range(n - 2 * period + 1):
            if 2 * prefix + 3 * period >= cost:
                break
            if all(ids[i] == ids[i + period] for i in range(prefix, n - period)):
                best, cost = (prefix, period), 2 * prefix + 3 * period
                break
    return best


def truncated(config, n: int):
    """`config` with its text model cut to the first `n` decoder layers (and every per-layer list cut with it)."""
    config = copy.deepcopy(config)
    text = text_config(config)
    total = text.num_hidden_layers
    for key, value in list(vars(text).items()):
        if isinstance(value, list | tuple) and len(value) == total and key != "num_hidden_layers":
            setattr(text, key, type(value)(value[:n]))
    text.num_hidden_layers = n
    return config


def plan(cls, config, dtype, min_first: int = 2) -> Layers | None:
    """How to trace `config`'s model from fewer layers, or None to trace it whole (too few layers to save time, no
    decoder stack found, or layers whose pattern truncation does not keep)."""
    total = getattr(text_config(config), "num_hidden_layers", None)
    if not isinstance(total, int):
        return None
    full = _layer_signatures(cls, config, dtype, total)
    if full is None:
        return None
    prefix, period = period_of(full)
    first = max(prefix + period, min_first)
    first += (total - first) % period  # first ≡ total (mod period)
    if 2 * first + period + SAVING > total:  # two traces of that many layers would cost about as much as one whole
        return None
    for n in (first, first + period):
        if _layer_signatures(cls, truncated(config, n), dtype, n) != full[:n]:
            return None
    return Layers(total, first, period)


def _layer_signatures(cls, config, dtype, count: int) -> list[tuple] | None:
    with torch.device("meta"):
        model = cls(config)
    model.to(dtype)
    found = decoder_layers(model, count)
    return None if found is None else [signature(layer) for layer in found[1]]


class Segments:
    """Each mark window's peak split where the step enters and leaves the decoder stack ("pre", "in", "post"; in
    backward the stack is entered at the last layer's output gradient and left at the first layer's input
    gradient). Within one segment the peak is affine in the depth; across segments it need not be, so
    `Layers.extrapolate_marks` extrapolates segment by segment."""

    def __init__(self, layers: torch.nn.ModuleList | None):
        self.by_label: dict[str, tuple[dict[str, int], int]] = {}
        self._window: dict[str, int] = {}
        self._current, self._pm, self._backward = "pre", None, False
        self._handles = []
        if layers is not None and len(layers):
            self._handles = [
                layers[0].register_forward_pre_hook(self._first_layer, with_kwargs=True),
                layers[-1].register_forward_hook(self._last_layer),
            ]

    def _enter(self, segment: str) -> None:
        if self._pm is None:
            return
        _, peak = self._pm.window()
        self._window[self._current] = max(self._window.get(self._current, 0), peak)
        self._current = segment

    def _first_layer(self, module, args, kwargs):
        if self._backward:  # a checkpointed layer recomputed in backward: not the forward's entry
            return
        self._enter("in")
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: self._enter("post"))

    def _last_layer(self, module, args, output):
        if self._backward:
            return
        self._enter("post")
        hidden = output[0] if isinstance(output, tuple | list) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: self._enter("in"))

    def watch(self, pm, backward: bool):
        """Context of one forward or backward under `pm`."""
        from contextlib import contextmanager

        @contextmanager
        def watching():
            self._pm, self._backward = pm, backward
            try:
                yield
            finally:
                self._pm, self._backward = None, False

        return watching()

    def mark(self, pm, label: str) -> None:
        """`pm.mark(label)`, keeping the window's segment peaks (the mark's own peak after the last segment)."""
        self._pm = pm
        self._enter("pre")
        self._pm = None
        m = pm.mark(label)
        segs = dict(self._window)
        segs["end"] = m.peak_bytes
        self.by_label[label] = (segs, m.live_bytes)
        self._window, self._current = {}, "pre"

    def marks(self) -> dict[str, tuple[int, int]]:
        return {label: (max(segs.values()), live) for label, (segs, live) in self.by_label.items()}

    def less(self, host: int) -> Segments:
        """These figures less `host` bytes (the host embedding table, see `trace._host_table_bytes`)."""
        for label, (segs, live) in self.by_label.items():
            self.by_label[label] = ({k: v - host for k, v in segs.items()}, live - host)
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
