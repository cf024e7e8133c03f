"""User-facing errors: one clear line on stderr and exit code 2 (the CLI catches `UserError`)."""

from __future__ import annotations

import signal


class UserError(Exception):
    """Something the user gave us is wrong; the message says what and how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """All the problems of one recipe, reported together."""

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = problems
        if len(problems) == 1:
            message = f"{source}: {problems[0]}"
        else:
            message = f"{source}: {len(problems)} problems: " + "; ".join(problems)
        super().__init__(message)


class Interrupted(UserError):
    """The run stopped on a signal (`lowmem_ft.train.resilience.interrupt`): exit code 128 + the signal's number, as a shell
    reports a process a signal ended — 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signal.Signals(signum)
        self.exit_code = 128 + self.signum.value
