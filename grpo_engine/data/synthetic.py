"""Seeded synthetic tasks with exact integer answers (the embedded demos and tests).

- ``arithmetic_task`` draws distinct problems ``a op b`` with both operands of exactly ``digits``
  digits (``10**(digits-1)`` to ``10**digits - 1``) and ``op`` among ``+``, ``-``, ``*``; the target is
  the exact result (negative for some subtractions).
- ``comparison_task`` draws distinct lists of ``count`` different ``digits``-digit numbers and asks for
  the largest or the smallest (``kinds``); the target is that number.

Each samples without replacement from the space of all its problems with ``random.Random(seed)``, so
the result depends only on the arguments: no problem appears twice, and none in both splits.
"""

from __future__ import annotations

import math
import operator
import random
import string
from collections.abc import Callable, Sequence

from grpo_engine.data.errors import DataError
from grpo_engine.types import Prompt

__all__ = ["arithmetic_task", "comparison_task"]

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}


def arithmetic_task(
    num_train: int,
    num_test: int,
    *,
    seed: int = 0,
    digits: int = 2,
    ops: Sequence[str] = ("+", "-"),
    question: str | Sequence[str] = "What is {a} {op} {b}?",
) -> tuple[list[Prompt], list[Prompt]]:
    """Builds disjoint train and test splits of integer arithmetic problems.

    Args:
        num_train: number of training prompts (>= 0).
        num_test: number of test prompts (>= 0).
        seed: seed of the ``random.Random`` that draws the problems (global state is untouched).
        digits: digits of each operand (2 gives operands 10..99).
        ops: the operators to draw from, a non-empty subset of ``"+"``, ``"-"``, ``"*"``.
        question: a ``str.format`` template with the fields ``{a}``, ``{b}`` and optionally
            ``{op}``, or several templates, one drawn per problem (with the same seeded
            generator) to vary the phrasing.

    Returns:
        ``(train, test)``: prompts whose ``target`` is the result as a string (``"-45"``) and
        whose ``metadata`` is ``{"a": a, "op": op, "b": b}``.

    Raises:
        DataError: an argument is out of range, or more problems are requested than exist.

    Example:
        >>> train, test = arithmetic_task(3, 2, seed=0)
        >>> len(train), len(test)
        (3, 2)
        >>> p = train[0]
        >>> p.question == f"What is {p.metadata['a']} {p.metadata['op']} {p.metadata['b']}?"
        True
    """
    templates = [question] if isinstance(question, str) else list(question)
    _check_arguments(num_train, num_test, digits, ops, templates)
    low, high = 10 ** (digits - 1), 10**digits - 1
    span = high - low + 1
    total = len(ops) * span * span
    wanted = num_train + num_test
    if wanted > total:
        raise DataError(
            f"num_train + num_test = {num_train} + {num_test} = {wanted} exceeds the {total} "
            f"distinct problems with digits={digits} and ops={tuple(ops)}; "
            "ask for fewer, or raise digits or add ops"
        )
    rng = random.Random(seed)
    prompts = []
    for index in rng.sample(range(total), wanted):
        op_index, rest = divmod(index, span * span)
        a, b = low + rest // span, low + rest % span
        op = ops[op_index]
        text = rng.choice(templates).format(a=a, op=op, b=b)
        target = str(_OPS[op](a, b))
        prompts.append(Prompt(text, target=target, metadata={"a": a, "op": op, "b": b}))
    return prompts[:num_train], prompts[num_train:]


def comparison_task(num_train: int, num_test: int, *, seed: int = 0, count: int = 3, digits: int = 2,
                    kinds: Sequence[str] = ("largest", "smallest"),
                    question: str = "Which is the {kind} of {numbers}?") -> tuple[list[Prompt], list[Prompt]]:
    """Builds disjoint train and test splits of "which is the largest / smallest of these numbers" problems.

    Args:
        num_train, num_test: numbers of prompts (>= 0).
        seed: seed of the ``random.Random`` that draws the problems (global state is untouched).
        count: how many different numbers a problem lists (2 to 9).
        digits: digits of each number (2 gives 10..99).
        kinds: what is asked, a non-empty subset of ``"largest"``, ``"smallest"``.
        question: a ``str.format`` template with the fields ``{kind}`` and ``{numbers}`` (written
            ``"38, 91 and 57"``).

    Returns:
        ``(train, test)``: prompts whose ``target`` is the answer as a string and whose ``metadata`` is
        ``{"numbers": (...), "kind": kind}``.

    Raises:
        DataError: an argument is out of range, or more problems are requested than exist.

    Example:
        >>> train, _ = comparison_task(2, 1, seed=0)
        >>> p = train[0]
        >>> p.target == str((max if p.metadata["kind"] == "largest" else min)(p.metadata["numbers"]))
        True
    """
    _check_arguments(num_train, num_test, digits, ("+",), ["{a}{b}"])
    if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= 9:
        raise DataError(f"count={count!r} must be an int from 2 to 9 (the numbers a problem lists)")
    known = not isinstance(kinds, str) and bool(kinds) and set(kinds) <= {"largest", "smallest"}
    if not known or len(set(kinds)) != len(kinds):
        raise DataError(f"kinds={kinds!r} must be a non-empty sequence of distinct kinds among 'largest' and "
                        "'smallest'; for example kinds=('largest',)")
    low, high = 10 ** (digits - 1), 10**digits
    if high - low < count:
        raise DataError(f"count={count} different numbers of {digits} digit(s) do not exist; lower count")
    rng, seen, prompts = random.Random(seed), set(), []
    wanted, total = num_train + num_test, math.perm(high - low, count) * len(kinds)
    if wanted > total:
        raise DataError(f"num_train + num_test = {wanted} exceeds the {total} distinct problems with "
                        f"count={count}, digits={digits} and kinds={tuple(kinds)}; ask for fewer, or raise "
                        "digits")
    while len(prompts) < wanted:
        numbers, kind = tuple(rng.sample(range(low, high), count)), rng.choice(list(kinds))
        if (numbers, kind) in seen:
            continue
        seen.add((numbers, kind))
        listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
        target = str(max(numbers) if kind == "largest" else min(numbers))
        prompts.append(Prompt(question.format(kind=kind, numbers=listed), target=target,
                              metadata={"numbers": numbers, "kind": kind}))
    return prompts[:num_train], prompts[num_train:]


def _check_arguments(
    num_train: int, num_test: int, digits: int, ops: Sequence[str], templates: list[str]
) -> None:
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DataError(f"{name}={value!r} must be an int >= 0")
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise DataError(f"digits={digits!r} must be an int >= 1 (2 gives operands 10..99)")
    valid = not isinstance(ops, str) and len(ops) > 0 and all(op in _OPS for op in ops)
    if not valid or len(set(ops)) != len(ops):
        raise DataError(
            f"ops={ops!r} must be a non-empty sequence of distinct operators among "
            f"{tuple(_OPS)}; for example ops=('+', '-')"
        )
    if not templates:
        raise DataError("question=[] holds no template; pass a str such as 'What is {a} {op} {b}?'")
    for template in templates:
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        except ValueError as err:
            raise DataError(
                f"question template {template!r} is not a valid str.format template ({err})"
            ) from err
        if not {"a", "b"} <= fields <= {"a", "op", "b"}:
            raise DataError(
                f"question template {template!r} uses the fields {sorted(fields)}; it must use "
                "{a} and {b}, may use {op}, and nothing else (write literal braces as {{ }})"
            )
