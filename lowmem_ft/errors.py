"""User-facing errors: one clear line on stderr and exit code 2 (the CLI catches `UserError`)."""

from __future__ import annotations


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
