"""The data package's one error, ``DataError``, and ``data_error``, which lists every bad record in one.

Below every other module of the package: the loaders, the templates, the stream and the checks all
raise it, and none of them needs another to do so.
"""

from __future__ import annotations

__all__ = ["DataError", "MAX_LISTED", "data_error"]


class DataError(ValueError):
    """A data file, record or data-package argument that cannot be used as given."""


MAX_LISTED = 20  # problems listed in one DataError; the rest are counted


def data_error(problems: list[str], source: str, fix: str = "") -> DataError:
    """One error listing every problem (the first ``MAX_LISTED``), each with its file and line; a lone
    problem without ``fix`` is the message itself.

    Example:
        >>> print(data_error(["a.jsonl:3: no question", "a.jsonl:7: no answer"], "a.jsonl"))
        a.jsonl: 2 bad record(s):
          a.jsonl:3: no question
          a.jsonl:7: no answer
    """
    if len(problems) == 1 and not fix:
        return DataError(problems[0])
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return DataError(f"{source}: {len(problems)} bad record(s){'; ' + fix if fix else ''}:\n  "
                     + "\n  ".join(problems[:MAX_LISTED]) + more)
