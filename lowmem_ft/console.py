"""What a command prints besides its own results: log levels, library noise, `--quiet` and `--debug`.

Three levels. normal: lowmem-ft's own log lines, the libraries' warnings that concern the run, progress bars.
quiet: errors, lowmem-ft's own warnings and the final summary — no progress bars, no per-step log lines, no library
chatter. debug: everything — the libraries' INFO logs, every Python warning, full tracebacks.

Library noise that says nothing about the user's run is filtered one message at a time — by message and module, each
entry naming the library call that emits it and why it is noise here — never a category or a whole library, so a new
warning still shows. `--debug` turns every filter off. The level travels to the processes of `train --gpus` through
the environment (`LOWMEM_FT_QUIET`, `LOWMEM_FT_DEBUG`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from typing import Literal

Level = Literal["quiet", "normal", "debug"]
QUIET_ENV = "LOWMEM_FT_QUIET"
DEBUG_ENV = "LOWMEM_FT_DEBUG"

# (category, message regex, module regex): Python warnings that are noise in a lowmem-ft run.
WARNING_FILTERS: list[tuple[type[Warning], str, str]] = [
    # transformers 5 renamed is_gradient_checkpointing to is_activation_checkpointing (the alias warns on every read);
    # lowmem-ft reads the new name, but peft 0.21's PeftModel.__init__ (`getattr(model, "is_gradient_checkpointing")`)
    # and TRL 1.16's models/utils.py still read the old one, once per model build.
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated", r"transformers\.modeling_utils"),
    # bitsandbytes' paged optimizers page through CUDA unified memory; on the CPU (tests, the demo) their states are
    # ordinary host tensors, which is what bnb's fallback says on the first step (bitsandbytes/optim/optimizer.py).
    (UserWarning, r"Paged optimizers are not supported on CPU", r"bitsandbytes\.optim"),
]
# (logger, message prefix): library log records that are noise in a lowmem-ft run.
LOG_FILTERS: list[tuple[str, str]] = [
    # bitsandbytes 0.50 on an AVX512-BF16 CPU tries an optional faster 4-bit kernel from the `kernels` package at
    # import and logs a warning without it; the built-in CPU kernel computes the same (bitsandbytes/backends/cpu/ops.py).
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
    # peft 0.21's adapter save (`get_peft_model_state_dict`) reads the base's config.json with the model's own config
    # class to compare vocab_size; over a Qwen (v1) base, loaded as Qwen2 (lowmem_ft.native), transformers says the
    # types differ — the one key peft reads has the same name and meaning in both (configuration_utils.py).
    ("transformers.configuration_utils", "You are using a model of type `qwen` to instantiate a model of type `qwen2`"),
]
# Environment the libraries read at import: no progress bars, no chatter (set only under --quiet, before the import).
QUIET_LIBRARIES = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub, and transformers' bars ("Loading weights", shards)
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets' map / filter bars
    "TRANSFORMERS_VERBOSITY": "error",
    "WANDB_SILENT": "true",  # W&B's start and end banners
}


def level() -> Level:
    """This process's level, from the environment (`setup` puts the command line's there)."""
    if os.environ.get(DEBUG_ENV):
        return "debug"
    return "quiet" if os.environ.get(QUIET_ENV) else "normal"


def quiet() -> bool:
    return level() == "quiet"


class _Drop(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def filter_library_noise() -> None:
    """Install the narrow filters above (warnings filters go first, so they win over a later `simplefilter`)."""
    for category, message, module in WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefix in LOG_FILTERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_Drop(prefix))


# The lowest level shown, per level: lowmem-ft's own loggers, and everyone else's.
SHOWN = {
    "quiet": (logging.WARNING, logging.ERROR),
    "normal": (logging.INFO, logging.WARNING),
    "debug": (logging.DEBUG, logging.DEBUG),
}


class _Shown(logging.Filter):
    """Passes a record at or above its logger's threshold: lowmem-ft's own, or a library's."""

    def __init__(self, chosen: Level):
        super().__init__()
        self.ours, self.theirs = SHOWN[chosen]

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == "lowmem_ft" or record.name.startswith("lowmem_ft.")
        return record.levelno >= (self.ours if ours else self.theirs)


def _logging(chosen: Level) -> None:
    """One stderr handler on the root logger that shows what `chosen` shows. Where logging is configured already
    (an application embedding the CLI, pytest), it is left as it is, as `logging.basicConfig` would."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_Shown(chosen))
    root.addHandler(handler)
    root.setLevel(SHOWN[chosen][0] if chosen == "debug" else logging.INFO)


_SAID: set[tuple] = set()  # what `first_time` has seen in this command


def first_time(*key) -> bool:
    """True the first time `key` is seen in this command (`setup` starts each command afresh): for a warning that
    two steps of one command would both give — the plan and the run each load the tokenizer and read the data, a
    stream is read on every pass — so that it is said once."""
    if key in _SAID:
        return False
    _SAID.add(key)
    return True


def setup(quiet: bool = False, debug: bool = False) -> Level:
    """Configure this process for a command: levels, filters, the libraries' environment. Returns the level."""
    _SAID.clear()
    if debug:
        os.environ[DEBUG_ENV] = "1"
    elif quiet:
        os.environ[QUIET_ENV] = "1"
    chosen = level()
    _logging(chosen)
    if chosen == "debug":
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "info")
        return chosen
    filter_library_noise()
    if chosen == "quiet":
        for key, value in QUIET_LIBRARIES.items():
            os.environ.setdefault(key, value)
    return chosen


def rich_console():
    """A Rich console that prints text as given: no markup, no emoji codes. What the tables print comes from users
    and models (model ids, paths, recipe values, library messages), where `[/INST]`, `data[1].jsonl` or `:x:` are
    text — Rich markup would drop `[bold]`-like pieces and raise on a stray `[/...]`. Style goes in `rich.text.Text`."""
    from rich.console import Console

    return Console(markup=False, emoji=False)


def quiet_stdout():
    """Under --quiet, swallow what a library prints to stdout inside the block (transformers prints "[INFO] Running
    in WANDB offline mode" when its tracker integrations are first imported); otherwise leave stdout alone."""
    return contextlib.redirect_stdout(io.StringIO()) if quiet() else contextlib.nullcontext()
