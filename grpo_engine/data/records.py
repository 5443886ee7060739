"""Prompts from the records users already have: a ``datasets.Dataset`` or ``IterableDataset``, a list of
dicts, or ``Prompt`` objects (returned as they are).

- The question is the ``question`` column (default: the first of ``prompt``, ``question``, ``problem``,
  ``query``, ``input``, ``instruction``), plain text or a TRL-style conversation (a list of
  ``{"role", "content"}`` messages).
- The reference answer is the ``answer`` column (default: the first of ``answer``, ``target``,
  ``ground_truth``, ``reference_answer``, ``final_answer``, ``solution`` (TRL's); none found means no
  target), a string or a number, optionally mapped by ``answer_fn`` (e.g. ``gsm8k_final_answer``).
- Every other column, the answer's included, travels in ``Prompt.metadata`` and reaches the rewards
  (a plain reward function receives each as a keyword argument), with the row's index for messages.
- Every bad row is reported at once, in one :class:`DataError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from grpo_engine.data.errors import DataError, data_error
from grpo_engine.types import Prompt

__all__ = ["QUESTION_COLUMNS", "ANSWER_COLUMNS", "to_prompts"]

QUESTION_COLUMNS = ("prompt", "question", "problem", "query", "input", "instruction")
ANSWER_COLUMNS = ("answer", "target", "ground_truth", "reference_answer", "final_answer", "solution")
AUTO = "auto"


def to_prompts(data: Iterable[Any], *, question: str | None = None, answer: str | None = AUTO,
               answer_fn: Callable[[str], str] | None = None, name: str = "data") -> list[Prompt]:
    """The training prompts of ``data`` (see the module docstring).

    Args:
        data: a ``datasets.Dataset`` / ``IterableDataset``, a list of dicts, or ``Prompt`` objects.
        question: the column holding the question (plain text or chat messages).
        answer: the column holding the reference answer; ``"auto"`` looks for a usual name, ``None``
            means no target.
        answer_fn: maps the answer text to the target (e.g. ``gsm8k_final_answer``).
        name: how messages name the data (``data[12]: ...``).

    Raises:
        DataError: no question column, or bad rows (each named with its index).

    Example:
        >>> rows = [{"prompt": "2+2?", "answer": 4, "level": 1}]
        >>> p = to_prompts(rows)[0]
        >>> p.question, p.target, p.metadata["level"], p.metadata["answer"]
        ('2+2?', '4', 1, 4)
    """
    if _is_split_dict(data):
        raise DataError(f"{name} is a dict of splits ({list(data.keys())}); pass one split, "
                        "e.g. data['train']")
    if isinstance(data, (str, bytes, Mapping)):
        raise DataError(f"{name} must be rows (a datasets.Dataset, a list of dicts or of Prompt), got "
                        f"{type(data).__name__}")
    rows = list(data)
    if not rows:
        raise DataError(f"{name} holds no rows; pass at least one prompt")
    if all(isinstance(row, Prompt) for row in rows):
        return rows
    columns = list(rows[0]) if isinstance(rows[0], Mapping) else []
    question = question or next((c for c in QUESTION_COLUMNS if c in columns), None)
    if question is None:
        raise DataError(f"{name}: no question column among {columns}; pass question='...' naming it "
                        f"(the usual names are {list(QUESTION_COLUMNS)})")
    if answer == AUTO:
        answer = next((c for c in ANSWER_COLUMNS if c in columns), None)
    prompts, problems = [], []
    for index, row in enumerate(rows):
        try:
            prompts.append(_row_prompt(row, index, name, question, answer, answer_fn))
        except DataError as err:
            problems.append(str(err))
    if problems:
        raise data_error(problems, name)
    return prompts


def _is_split_dict(data: Any) -> bool:
    return isinstance(data, Mapping) and bool(data) and all(hasattr(v, "column_names") for v in data.values())


def _row_prompt(row: Any, index: int, name: str, question: str, answer: str | None,
                answer_fn: Callable[[str], str] | None) -> Prompt:
    where = f"{name}[{index}]"
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected a row (a dict of columns), got {type(row).__name__}")
    if question not in row:
        raise DataError(f"{where}: no {question!r} column (columns: {list(row)}); pass question='...'")
    content = _content(row[question], where, question)
    target = None
    if answer is not None:
        value = row.get(answer)
        if value is None:
            raise DataError(f"{where}: {answer!r} is missing or null; every row needs its reference answer "
                            "(or pass answer=None for rewards that need none)")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(f"{where}: {answer!r} must be a string or a number, got {type(value).__name__}")
        target = str(value)
        if answer_fn is not None:
            try:
                target = answer_fn(target)
            except DataError as err:
                raise DataError(f"{where}: {err}") from err
        if not target.strip():
            raise DataError(f"{where}: the reference answer {answer!r} is empty")
    metadata = {k: v for k, v in row.items() if k != question}
    for key, value in (("source", name), ("index", index)):
        metadata.setdefault(key, value)  # the row's own columns win
    return Prompt(content, target=target, metadata=metadata)


def _content(value: Any, where: str, column: str) -> str | tuple[dict[str, Any], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {column!r} is empty")
        return value
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return tuple(dict(m) for m in value)
    raise DataError(f"{where}: {column!r} must be text or a list of chat messages "
                    f"({{'role': ..., 'content': ...}}), got {type(value).__name__} {str(value)[:60]!r}")
