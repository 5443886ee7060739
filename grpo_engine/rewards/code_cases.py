"""The test cases of a code task, read on the host: what crosses into the sandbox, what stays out, and
how the host compares what came back (used by :class:`~grpo_engine.rewards.CodeTests`).

A test is one of:

- ``{"fn": "f", "args": [2], "kwargs": {}, "expected": 4}``: a call test (:class:`CallCase`);
- ``{"input": "2\\n", "output": "4\\n"}``: a stdin/stdout test (:class:`StdioCase`), the APPS /
  CodeContests / LiveCodeBench format;
- ``"assert f(2) == 4"``: an assert, converted here into a call test by :func:`from_assert`, or run inside
  the sandbox (:class:`AssertCase`) where the user allows it.

Only a call's function name and argument literals (and, opt-in, assert snippets) enter the sandbox; the
expected values stay here. A call's result comes back as JSON of plain data (:func:`plain`: exact ``int``,
``float``, ``bool``, ``None``, ``str``, ``list``, ``tuple`` as a list, ``dict`` with ``str`` keys), so
nothing the program defines (an ``__eq__``, a subclass) takes part in the comparison. Pure functions.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["AssertCase", "CallCase", "CaseError", "StdioCase", "from_assert", "outputs_match", "parse_case",
           "plain", "values_match"]

FIX = ("write it as `assert f(<literals>) == <literal>` (docs/rewards.md lists the forms), or as a call "
       "test {\"fn\": \"f\", \"args\": [...], \"expected\": ...} or a stdin/stdout test {\"input\": ..., "
       "\"output\": ...}; or pass CodeTests(allow_in_sandbox_asserts=True) to run it inside the sandbox, "
       "where the program can forge its result")


class CaseError(ValueError):
    """A test that cannot be read as a case (the message says why)."""


@dataclasses.dataclass(frozen=True)
class CallCase:
    """Call ``fn(*args, **kwargs)`` in the program's namespace; the host judges the returned value.

    ``args`` / ``kwargs`` are Python literal source (a tuple, a dict), evaluated afresh in the sandbox for
    each call. ``check`` is ``"=="`` (``values_match`` with ``expected``), ``"is"`` (``expected`` is True,
    False or None), ``"truthy"`` or ``"falsy"``. A tolerance of None means the reward's own.
    """

    fn: str
    args: str
    kwargs: str
    check: str
    expected: Any = None
    rel_tol: float | None = None
    abs_tol: float | None = None


@dataclasses.dataclass(frozen=True)
class StdioCase:
    """Run the program with ``input`` on stdin; the host compares its stdout with ``output``."""

    input: str
    output: str
    rel_tol: float | None = None
    abs_tol: float | None = None


@dataclasses.dataclass(frozen=True)
class AssertCase:
    """An assert run inside the sandbox (opt-in): the program can forge its result."""

    source: str


Case = CallCase | StdioCase | AssertCase


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON data (tuples become lists), or CaseError when it holds anything else: a
    subclass, a set, bytes, a dict with a key that is not a ``str``."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if depth > 100:
        raise CaseError("it is nested more than 100 levels deep")
    if kind in (list, tuple):
        return [plain(item, depth + 1) for item in value]
    if kind is dict and all(type(key) is str for key in value):
        return {key: plain(item, depth + 1) for key, item in value.items()}
    raise CaseError(f"{value!r} is not plain JSON data (int, float, bool, None, str, list, tuple, dict with "
                    "str keys): results cross the sandbox as JSON")


def _close(actual: Any, expected: Any, rel_tol: float, abs_tol: float) -> bool:
    numbers = (int, float)
    if type(actual) in numbers and type(expected) in numbers:
        try:
            return math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=abs_tol)
        except OverflowError:  # an int too large for a float
            return actual == expected
    if type(actual) is list and type(expected) is list:
        return len(actual) == len(expected) and all(
            _close(a, e, rel_tol, abs_tol) for a, e in zip(actual, expected))
    if type(actual) is dict and type(expected) is dict:
        return actual.keys() == expected.keys() and all(
            _close(actual[key], expected[key], rel_tol, abs_tol) for key in expected)
    return actual == expected


def values_match(actual: Any, expected: Any, rel_tol: float = 0.0, abs_tol: float = 0.0) -> bool:
    """Whether two plain values are equal: Python's ``==`` (so ``4 == 4.0`` and ``True == 1``, as the
    assert would say; NaN equals nothing), or, with a tolerance, numbers inside them (not bools) within
    ``math.isclose(rel_tol, abs_tol)``.

    Example:
        >>> values_match([1, 0.30000000000000004], [1, 0.3]), values_match([1, 0.3 + 1e-12], [1, 0.3], 1e-9)
        (False, True)
    """
    try:
        if rel_tol == 0 and abs_tol == 0:
            return bool(actual == expected)
        return _close(actual, expected, rel_tol, abs_tol)
    except RecursionError:
        return False


def output_lines(text: str) -> list[str]:
    """``text``'s lines, each without its trailing whitespace, without the trailing blank lines."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _tokens_match(actual: str, expected: str, rel_tol: float, abs_tol: float) -> bool:
    if actual == expected:
        return True
    try:
        return math.isclose(float(actual), float(expected), rel_tol=rel_tol, abs_tol=abs_tol)
    except ValueError:
        return False


def outputs_match(actual: str, expected: str, rel_tol: float = 0.0, abs_tol: float = 0.0) -> bool:
    """Whether a program's stdout is the expected output: the same lines once each line's trailing whitespace
    and the trailing blank lines are dropped; with a tolerance, a line that differs may still match
    token by token (split on whitespace), two tokens that both read as floats within the tolerance.

    Example:
        >>> outputs_match("4 \\n\\n", "4"), outputs_match("0.3333333333", "0.333333333333", 1e-9, 1e-9)
        (True, True)
    """
    got, want = output_lines(actual), output_lines(expected)
    if len(got) != len(want):
        return False
    tolerant = rel_tol > 0 or abs_tol > 0
    for line, wanted in zip(got, want):
        if line == wanted:
            continue
        tokens, wanted_tokens = line.split(), wanted.split()
        if not tolerant or len(tokens) != len(wanted_tokens) or not all(
                _tokens_match(a, e, rel_tol, abs_tol) for a, e in zip(tokens, wanted_tokens)):
            return False
    return True


def _literal(node: ast.expr) -> Any:
    """``node``'s value when it is a Python literal, else CaseError."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise CaseError(f"`{ast.unparse(node)}` is not a literal") from None


def _call(node: ast.expr) -> tuple[str, str, str] | None:
    """``(fn, args source, kwargs source)`` when ``node`` is ``name(<literal>, key=<literal>)``, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    if any(isinstance(arg, ast.Starred) for arg in node.args) or any(k.arg is None for k in node.keywords):
        return None
    try:
        for value in (*node.args, *(k.value for k in node.keywords)):
            _literal(value)
    except CaseError:
        return None
    args = ast.unparse(ast.Tuple(elts=list(node.args), ctx=ast.Load()))
    kwargs = "{" + ", ".join(f"{k.arg!r}: {ast.unparse(k.value)}" for k in node.keywords) + "}"
    return node.func.id, args, kwargs


def _tolerance(node: ast.expr) -> float:
    value = _literal(node)
    if type(value) not in (int, float) or not 0 <= value < math.inf:
        raise CaseError(f"the tolerance `{ast.unparse(node)}` is not a finite number >= 0")
    return float(value)


def _isclose(test: ast.Call) -> CallCase | None:
    """``[math.]isclose(<call>, <literal>[, rel_tol=..., abs_tol=...])`` (either order) as a call case."""
    func = test.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name != "isclose" or len(test.args) != 2:
        return None
    first, second = test.args
    call, value = (_call(first), second) if _call(first) else (_call(second), first)
    tolerances = {"rel_tol": 1e-9, "abs_tol": 0.0}  # math.isclose's defaults
    if call is None or any(k.arg not in tolerances for k in test.keywords):
        return None
    tolerances.update({k.arg: _tolerance(k.value) for k in test.keywords})
    return CallCase(*call, "==", _expected(value), tolerances["rel_tol"], tolerances["abs_tol"])


def _abs_within(test: ast.Compare) -> CallCase | None:
    """``abs(<call> - <literal>) < eps`` (or ``<=``, either order inside) as a call case within ``eps``."""
    left = test.left
    if not (isinstance(test.ops[0], (ast.Lt, ast.LtE)) and isinstance(left, ast.Call)
            and isinstance(left.func, ast.Name) and left.func.id == "abs" and len(left.args) == 1
            and not left.keywords and isinstance(left.args[0], ast.BinOp)
            and isinstance(left.args[0].op, ast.Sub)):
        return None
    first, second = left.args[0].left, left.args[0].right
    call, value = (_call(first), second) if _call(first) else (_call(second), first)
    if call is None:
        return None
    return CallCase(*call, "==", _expected(value), 0.0, _tolerance(test.comparators[0]))


def _expected(node: ast.expr) -> Any:
    return _expected_value(_literal(node))


def _compare(test: ast.Compare) -> CallCase | None:
    if len(test.ops) != 1:
        return None
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq) and (_call(left) or _call(right)):
        call, value = (_call(left), right) if _call(left) else (_call(right), left)
        return CallCase(*call, "==", _expected(value))
    if isinstance(op, ast.Is) and _call(left) and isinstance(right, ast.Constant) and (
            right.value is True or right.value is False or right.value is None):
        return CallCase(*_call(left), "is", right.value)
    return _abs_within(test)


@functools.lru_cache(maxsize=4096)
def from_assert(source: str) -> CallCase:
    """An assert as a call case, else CaseError saying why. The forms (``f`` any name, its arguments
    literals): ``f(...) == <literal>`` or ``<literal> == f(...)``; ``f(...) is True / False / None``;
    ``f(...)`` (the result must be truthy) and ``not f(...)`` (falsy); ``abs(f(...) - <literal>) < eps``
    (or ``<=``: within ``eps``); ``math.isclose(f(...), <literal>, rel_tol=..., abs_tol=...)``. An
    assert's message is ignored. The expected literal must be plain JSON data (:func:`plain`).

    Example:
        >>> from_assert("assert f(2, k='x') == (4, None)")
        CallCase(fn='f', args='(2,)', kwargs="{'k': 'x'}", check='==', expected=[4, None], rel_tol=None, \
abs_tol=None)
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        raise CaseError(f"it does not parse ({error.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise CaseError("it is not one assert statement (give each assert its own test)")
    test = tree.body[0].test
    case = None
    if isinstance(test, ast.Compare):
        case = _compare(test)
    elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _call(test.operand):
        case = CallCase(*_call(test.operand), "falsy")
    elif _call(test):
        case = CallCase(*_call(test), "truthy")
    elif isinstance(test, ast.Call):
        case = _isclose(test)
    if case is None:
        for node in ast.walk(test):  # say which argument is not a literal, if one is not
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                for arg in (*node.args, *(keyword.value for keyword in node.keywords)):
                    try:
                        _literal(arg)
                    except CaseError as error:
                        raise CaseError(f"{error} (in `{ast.unparse(node)}`): a checked call's arguments "
                                        "are literals") from None
        raise CaseError("its condition is none of the forms a host can check (a call of a function "
                        "with literal arguments, compared with a literal)")
    return case


def _call_case(test: Mapping[str, Any]) -> CallCase:
    fn, args, kwargs = test["fn"], test.get("args", []), test.get("kwargs", {})
    if not (isinstance(fn, str) and fn.isidentifier()):
        raise CaseError(f"\"fn\": {fn!r} is not a function name")
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, Mapping) or not all(
            isinstance(key, str) and key.isidentifier() for key in kwargs):
        raise CaseError("\"args\" must be a list and \"kwargs\" a dict of argument names")
    source, keywords = repr(tuple(args)), repr(dict(kwargs))
    try:
        same = ast.literal_eval(source) == tuple(args) and ast.literal_eval(keywords) == dict(kwargs)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        same = False
    if not same:
        raise CaseError("its arguments are not all Python literals (NaN and infinity are not)")
    if "expected" not in test:
        raise CaseError("a call test needs \"expected\"")
    return CallCase(fn, source, keywords, "==", _expected_value(test["expected"]), *_tolerances(test))


def _expected_value(value: Any) -> Any:
    try:
        return plain(value)
    except CaseError as error:
        raise CaseError(f"the expected value {error}") from None


def _tolerances(test: Mapping[str, Any]) -> tuple[float | None, float | None]:
    found = []
    for key in ("rel_tol", "abs_tol"):
        value = test.get(key)
        if value is not None and (type(value) not in (int, float) or not 0 <= value < math.inf):
            raise CaseError(f"\"{key}\": {value!r} is not a finite number >= 0")
        found.append(None if value is None else float(value))
    return found[0], found[1]


_KEYS = {"fn": {"fn", "args", "kwargs", "expected", "rel_tol", "abs_tol"},
         "input": {"input", "output", "testtype", "rel_tol", "abs_tol"}}


def parse_case(test: Any, *, allow_asserts: bool = False) -> Case:
    """One test of a task as a case, else CaseError saying why (without the fix: see ``FIX``). An assert
    that :func:`from_assert` cannot convert becomes an :class:`AssertCase` when ``allow_asserts``."""
    if isinstance(test, str):
        try:
            return from_assert(test)
        except CaseError:
            if allow_asserts:
                return AssertCase(test)
            raise
    if not isinstance(test, Mapping) or not ("fn" in test or "input" in test):
        raise CaseError("it is neither an assert (a str) nor a dict with \"fn\" (a call test) or \"input\" "
                        "(a stdin/stdout test)")
    kind = "fn" if "fn" in test else "input"
    unknown = sorted(set(test) - _KEYS[kind])
    if unknown:
        raise CaseError(f"unknown keys {unknown}; a {'call' if kind == 'fn' else 'stdin/stdout'} test has "
                        f"{sorted(_KEYS[kind])}")
    if kind == "fn":
        return _call_case(test)
    if test.get("testtype", "stdin") != "stdin":
        raise CaseError(f"\"testtype\": {test['testtype']!r}; only stdin tests are read here (a functional "
                        "test becomes a call test: {\"fn\": ..., \"args\": [...], \"expected\": ...})")
    if not isinstance(test["input"], str) or not isinstance(test.get("output"), str):
        raise CaseError("a stdin/stdout test needs \"input\" and \"output\" strings")
    return StdioCase(test["input"], test["output"], *_tolerances(test))
