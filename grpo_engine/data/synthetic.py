"""A seeded synthetic integer-arithmetic task (the embedded default for demos and tests).

Implemented: ``arithmetic_task`` draws distinct problems ``a op b`` with both operands of
exactly ``digits`` digits (``10**(digits-1)`` to ``10**digits - 1``) and ``op`` among ``+``,
``-``, ``*``. It samples without replacement from the space of all such problems with
``random.Random(seed)``, so the result depends only on the arguments: no problem appears twice,
and none appears in both splits. The target is the exact integer result (negative for some
subtractions).
"""

from __future__ import annotations

import operator
import random
import string
from collections.abc import Callable, Sequence

from grpo_engine.data.loaders import DataError
from grpo_engine.types import Prompt

__all__ = ["arithmetic_task"]

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
