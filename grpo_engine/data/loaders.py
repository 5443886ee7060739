"""Load question/answer files into ``Prompt`` records.

Implemented: ``load_jsonl_prompts`` (a ``.jsonl`` file, one object per line, blank lines
skipped, or a ``.json`` list of objects; ``target`` is the answer field, optionally mapped by
``answer_fn``; ``metadata`` holds the source, the record's location and its other fields),
``gsm8k_final_answer`` (text after the last ``####``, thousands commas removed), ``load_gsm8k``
(a local openai/grade-school-math JSONL file, or the hub's ``openai/gsm8k`` when no path is
given) and ``load_math500``. Every bad record (not UTF-8, not JSON, a missing or empty question or
answer, an answer that is not a string or a number) is reported at once, in one ``DataError``
naming each file and line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

from grpo_engine.data.errors import DataError, data_error
from grpo_engine.types import Prompt

__all__ = ["DataError", "gsm8k_final_answer", "load_gsm8k", "load_jsonl_prompts", "load_math500"]

Location = tuple[str, dict[str, Any]]  # ("file.jsonl:3", {"source": "file.jsonl", "line": 3})


class _Bad:
    """A record a reader could not read (the problem, at its location)."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def load_jsonl_prompts(
    path: str | Path,
    *,
    question_field: str = "question",
    answer_field: str | None = "answer",
    answer_fn: Callable[[str], str] | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """Reads prompts and reference answers from a ``.jsonl`` or ``.json`` file.

    A ``.json`` file must hold a list of objects; any other suffix is read as JSON Lines.

    Args:
        path: the file.
        question_field: the field holding the question text (a non-empty string).
        answer_field: the field holding the reference answer, or None for prompts without a
            target (rewards that need no reference).
        answer_fn: maps the answer text to the target (for example ``gsm8k_final_answer``);
            by default the target is ``str(answer)``.
        limit: read at most this many records (the first ones), or all when None.

    Returns:
        One ``Prompt`` per record, in file order. ``metadata`` holds ``"source"`` (the path as
        given), ``"line"`` (1-based line number, JSONL) or ``"index"`` (0-based list position,
        JSON), and every field of the record other than the question and answer fields.

    Raises:
        DataError: the file is missing, empty or not valid JSON, or a record lacks a field.

    Example:
        >>> load_jsonl_prompts("qa.jsonl", question_field="q")[0].target  # doctest: +SKIP
        '42'
    """
    records = _read_records(Path(path), str(path))
    return _to_prompts(records, question_field, answer_field, answer_fn, limit, str(path))


def gsm8k_final_answer(solution: str) -> str:
    """Returns the final answer of a GSM8K worked solution.

    Args:
        solution: the ``answer`` field of a GSM8K record, ending in ``#### <final answer>``.

    Returns:
        The text after the last ``####``, stripped, with thousands commas removed.

    Raises:
        DataError: the solution has no ``####`` marker.

    Example:
        >>> gsm8k_final_answer("5 * 200 = <<5*200=1000>>1,000 dollars\\n#### 1,000")
        '1000'
    """
    if "####" not in solution:
        raise DataError(
            f"GSM8K solution has no '####' final-answer marker: {solution[-80:]!r}; "
            "pass the 'answer' field of an openai/grade-school-math record"
        )
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_gsm8k(
    path: str | Path | None = None, *, split: str = "train", limit: int | None = None
) -> list[Prompt]:
    """Loads GSM8K with the final answer as target and the worked solution in metadata.

    Args:
        path: a local JSONL file in the openai/grade-school-math format (``question``,
            ``answer``); when None, the split is downloaded from the hub (``openai/gsm8k``).
        split: the hub split (``"train"`` or ``"test"``); ignored when ``path`` is given.
        limit: keep at most this many records (the first ones), or all when None.

    Returns:
        Prompts with ``target`` the final answer (``gsm8k_final_answer``) and
        ``metadata["solution"]`` the full worked solution.

    Raises:
        DataError: the file or the hub cannot be read, or a record is malformed.

    Example:
        >>> load_gsm8k("gsm8k/test.jsonl", limit=2)[0].target  # doctest: +SKIP
        '18'
    """
    source = str(path) if path is not None else f"openai/gsm8k:main/{split}"
    records = _read_records(Path(path), source) if path is not None else _hub_records(source, split)
    records = (
        (r, (where, {**meta, "solution": r.get("answer") if isinstance(r, Mapping) else None}))
        for r, (where, meta) in records
    )
    return _to_prompts(records, "question", "answer", gsm8k_final_answer, limit, source)


def load_math500(path: str | Path, *, limit: int | None = None) -> list[Prompt]:
    """Loads MATH-500 from its JSONL file, with the LaTeX final answer as target.

    Args:
        path: the JSONL file (fields problem/answer/solution/subject/level/unique_id).
        limit: keep at most this many records (the first ones), or all when None.

    Returns:
        Prompts with ``content`` the problem, ``target`` the answer and the other fields
        (``solution``, ``subject``, ``level``, ``unique_id``) in metadata.

    Example:
        >>> load_math500("math500/test.jsonl")[0].metadata["level"]  # doctest: +SKIP
        2
    """
    return load_jsonl_prompts(path, question_field="problem", answer_field="answer", limit=limit)


def _hub_records(source: str, split: str) -> Iterator[tuple[Any, Location]]:
    try:
        import datasets
    except ImportError as err:
        raise DataError(
            "load_gsm8k() without a path needs the 'datasets' package; "
            "pip install datasets, or pass the path of a local GSM8K JSONL file"
        ) from err
    try:
        ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except Exception as err:  # offline, unknown split, hub error: all say the same fix
        raise DataError(
            f"could not load GSM8K split {split!r} from the hub ({type(err).__name__}: {err}); "
            "when offline, pass the local file: load_gsm8k('path/to/gsm8k/test.jsonl')"
        ) from err
    for i, record in enumerate(ds):
        yield record, (f"{source}[{i}]", {"source": source, "index": i})


def _read_records(path: Path, name: str) -> Iterator[tuple[Any, Location]]:
    if not path.is_file():
        raise DataError(
            f"data file not found: {name} (resolved to {path.resolve()}); check the path"
        )
    return (_read_json if path.suffix == ".json" else _read_jsonl)(path, name)


def _read_jsonl(path: Path, name: str) -> Iterator[tuple[Any, Location]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = (f"{name}:{lineno}", {"source": name, "line": lineno})
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield _Bad(f"{name}:{lineno}: not UTF-8 (byte 0x{raw[err.start]:02x} "
                           f"at column {err.start + 1}); save the file as UTF-8"), where
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield _Bad(f"{name}:{lineno}: not valid JSON ({err})"), where
                continue
            yield record, where


def _read_json(path: Path, name: str) -> Iterator[tuple[Any, Location]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise DataError(f"{name}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x}); "
                        "save the file as UTF-8") from err
    if not text.strip():
        return iter(())
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{name}:{err.lineno}: not valid JSON ({err})") from err
    if not isinstance(data, list):
        raise DataError(
            f"{name}: a .json data file must hold a list of objects, got {type(data).__name__}; "
            "write a list, or one object per line in a .jsonl file"
        )
    return ((r, (f"{name}[{i}]", {"source": name, "index": i})) for i, r in enumerate(data))


def _to_prompts(
    records: Iterable[tuple[Any, Location]],
    question_field: str,
    answer_field: str | None,
    answer_fn: Callable[[str], str] | None,
    limit: int | None,
    source: str,
) -> list[Prompt]:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"limit={limit!r} must be a positive int, or None to read every record")
    prompts, problems = [], []
    for record, (where, meta) in islice(records, limit):
        if isinstance(record, _Bad):
            problems.append(record.problem)
            continue
        try:
            prompts.append(_to_prompt(record, where, meta, question_field, answer_field, answer_fn))
        except DataError as err:
            problems.append(str(err))
    if problems:
        raise data_error(problems, source)
    if not prompts:
        raise DataError(f"{source}: no records found (empty file or empty list); check the path")
    return prompts


def _to_prompt(
    record: Any,
    where: str,
    meta: dict[str, Any],
    question_field: str,
    answer_field: str | None,
    answer_fn: Callable[[str], str] | None,
) -> Prompt:
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key, arg in ((question_field, "question_field"), (answer_field, "answer_field")):
        if key is None or record.get(key) is not None:
            continue
        problem = f"{key!r} is null" if key in record else f"no {key!r} field"
        what = "question" if arg == "question_field" else "reference answer"
        raise DataError(
            f"{where}: {problem} (fields present: {list(record)}); "
            f"pass {arg}=... to name the field holding the {what}"
        )
    question = record[question_field]
    if not isinstance(question, str) or not question.strip():
        raise DataError(
            f"{where}: {question_field!r} must be a non-empty string, got {question!r}; "
            "fix the record or pass question_field=... to name the question field"
        )
    target = None
    if answer_field is not None:
        value = record[answer_field]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(f"{where}: {answer_field!r} must be a string or a number, "
                            f"got {type(value).__name__} {str(value)[:60]!r}; fix the record or pass "
                            "answer_field=... to name the answer field")
        answer = str(value)
        if not answer.strip():
            raise DataError(f"{where}: {answer_field!r} is empty; every record needs its reference answer")
        try:
            target = answer_fn(answer) if answer_fn is not None else answer
        except DataError as err:
            raise DataError(f"{where}: {err}") from err
        if not str(target).strip():
            raise DataError(f"{where}: the reference answer is empty after {answer_fn.__name__}; "
                            "fix the record")
    skip = {question_field, answer_field}
    extra = {k: v for k, v in record.items() if k not in skip}
    return Prompt(question, target=target, metadata={**extra, **meta})
