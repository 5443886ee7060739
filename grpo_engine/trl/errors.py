"""The one error of TRL's entry: :class:`TRLSettingError` lists every setting with no equivalent here, each
as ``name=value: why; nearest: ...`` (:func:`problem`)."""

from __future__ import annotations

from typing import Any

__all__ = ["Problem", "TRLSettingError", "problem"]

Problem = tuple[str, str]  # (the field, the message: value, why, nearest)


class TRLSettingError(ValueError):
    """TRL settings with no equivalent here: one line per field, each with its value, why and the nearest
    setting. ``problems``: the ``(field, message)`` pairs."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {message}" for _, message in self.problems)
        super().__init__(f"{len(self.problems)} TRL setting(s) with no equivalent in grpo_engine:\n{lines}")


def problem(name: str, value: Any, why: str, nearest: str) -> Problem:
    """A refused setting: ``name=value: why; nearest: ...``."""
    return name, f"{name}={value!r}: {why}; nearest: {nearest}"
