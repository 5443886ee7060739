"""CodeTests against a policy that hunts for a score without solving the task (issue 51).

The expected values stay on the host: the program's results leave the sandbox as data (each call's
return value as JSON, or its stdout) and the host compares them. Each route that scored 1.0 on
code that fails every test under the old harness (which ran the asserts in the program's process and
printed per-test verdicts keyed by a token) is written here as the policy would write it, and scores 0.
The sandbox tests skip where bubblewrap is missing (CI installs it); the conversion and the refusal run
everywhere.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from grpo_engine.rewards import CodeTests, WeightedSum
from grpo_engine.rewards import code as code_module
from grpo_engine.rewards.code_cases import (
    CallCase,
    CaseError,
    StdioCase,
    from_assert,
    outputs_match,
    parse_case,
    values_match,
)
from grpo_engine.sandbox import sandbox_available
from grpo_engine.types import Prompt, RolloutBatch

needs_sandbox = pytest.mark.skipif(sandbox_available() is not None,
                                   reason=f"no sandbox: {sandbox_available()}")

DOUBLE = Prompt("Write f(x) that doubles x.", metadata={"tests": [
    "assert f(2) == 4", "assert f(0) == 0", "assert f(-1) == -2"]})
WRONG_F = "def f(x):\n    return x + 100\n"  # fails all three tests


def score(reward: CodeTests, task: Prompt, *codes: str) -> list[float]:
    return reward([task] * len(codes), list(codes)).tolist()


# -- the six routes, each as the policy writes it; each now scores 0 --------------------------------------

REPLACE_EXEC = WRONG_F + """
import builtins
builtins.exec = lambda *args, **kwargs: None  # the old harness exec'd each assert: now a no-op, "passed"
"""

REWRITE_STDOUT = WRONG_F + """
import gc, io, sys

def rewriting(write):  # every verdict written becomes "passed"
    def rewrite(text):
        for word in ("assertion", "exception", "wrong", "unserialisable", "returned"):
            text = text.replace(word, "passed")
        return write(text)
    return rewrite

class Rewritten:
    def __init__(self, stream):
        self.stream, self.write = stream, rewriting(stream.write)
    def __getattr__(self, name):
        return getattr(self.stream, name)

sys.stdout = sys.__stdout__ = Rewritten(sys.stdout)
for stream in [o for o in gc.get_objects() if isinstance(o, io.TextIOWrapper)]:  # the harness's channel too
    stream.write = rewriting(stream.write)
"""


OVERWRITE_TESTS = WRONG_F + """
import __main__, gc
__main__._tests = ["pass"] * 3  # the old harness's list of asserts
for jobs in [o for o in gc.get_objects() if type(o) is list and o and type(o[0]) is dict and "fn" in o[0]]:
    jobs[:] = [{"assert": "pass"}] * len(jobs)  # ours: every call becomes a no-op assert
"""

READ_TOKEN = WRONG_F + """
import __main__, os, sys
frame = sys._getframe(1)  # the harness's frame: its token
token = getattr(__main__, "_token", None) or frame.f_locals.get("token")
lines = "".join(f"\\n{token} {i} passed\\n{token} {i} returned 7\\n" for i in range(3))
for fd in range(1, 10):
    try:
        os.write(fd, lines.encode())
    except OSError:
        pass
os._exit(0)
"""

LATE_ATEXIT = WRONG_F + """
import atexit, os, sys
token = sys._getframe(1).f_locals.get("token")
kept = []
for fd in range(1, 10):  # the harness closes its channel before exit: keep a copy of every descriptor
    try:
        kept.append(os.dup(fd))
    except OSError:
        pass

@atexit.register
def late():
    for fd in kept:
        try:
            os.write(fd, f"\\n{token} code passed\\n".encode()
                     + "".join(f"{token} {i} passed\\n" for i in range(3)).encode())
        except OSError:
            pass
"""


ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__

class Int(int):
    def __eq__(self, other):
        return True

class Text(str):
    def __eq__(self, other):
        return True

def f(x):  # f(2), f(0), f(-1)
    return {2: Anything(), 0: Int(7), -1: [Text("-2")]}[x]
"""


@needs_sandbox
@pytest.mark.parametrize("attack,kinds", [
    (REPLACE_EXEC, {"wrong": 3.0}),
    (REWRITE_STDOUT, {"error": 3.0}),  # lines that are not a result: no value, no pass
    (OVERWRITE_TESTS, {"error": 3.0}),  # "passed" is no result of a call test
    (READ_TOKEN, {"error": 3.0}),  # each index reported twice, with a verdict and a guess
    (LATE_ATEXIT, {"error": 3.0}),  # each index then reported twice
    (ALWAYS_EQUAL, {"unserialisable": 3.0}),
], ids=["replace-exec", "rewrite-stdout", "overwrite-tests", "read-token", "late-atexit", "always-equal"])
def test_each_forging_route_scores_zero(attack, kinds):
    reward = CodeTests(timeout_s=5)
    assert score(reward, DOUBLE, attack) == [0.0]
    assert reward.batch_metrics() == kinds


@needs_sandbox
def test_a_forged_value_passes_only_where_it_is_the_right_value():
    """The channel is the program's (it shares the harness's process): it can claim any value for a call,
    and the claim passes exactly when the value is the expected one, i.e. when it solved that call."""
    forged = WRONG_F + """
import os, sys
token = sys._getframe(1).f_locals["token"]
for fd in range(1, 10):
    try:
        os.write(fd, f'\\n{token} 0 returned 4\\n{token} 1 returned 5\\n{token} 2 returned "-2"\\n'.encode())
    except OSError:
        pass
os._exit(0)
"""
    reward = CodeTests(timeout_s=5)
    assert score(reward, DOUBLE, forged) == [pytest.approx(1 / 3)]  # 4 is f(2); 5 and "-2" are not
    assert reward.batch_metrics() == {"passed": 1.0, "wrong": 2.0}


@needs_sandbox
def test_asserts_run_in_the_sandbox_are_forgeable_as_the_docs_say():
    task = Prompt("q", metadata={"tests": ["assert sorted(f([3, 1])) == [1, 3]"]})
    assert CodeTests().check(task) is not None  # refused by default
    reward = CodeTests(timeout_s=5, allow_in_sandbox_asserts=True)
    assert reward.check(task) is None
    assert score(reward, task, "def f(x):\n    return x", "def f(x):\n    return [0]") == [1.0, 0.0]
    assert reward.batch_metrics() == {"assertion": 1.0, "passed": 1.0}
    assert score(reward, task, "def f(x):\n    return [0]\n" + REPLACE_EXEC) == [1.0]  # forged


# -- honest and partial solutions ------------------------------------------------------------------------

@needs_sandbox
def test_call_tests_score_the_fraction_passed_and_count_every_outcome():
    tests = ["assert f(2) == 4", "assert f(0) == 0", "assert f(-1) == -2", "assert g() == 1"]
    task = Prompt("Write f(x) that doubles x.", metadata={"tests": tests})
    reward = CodeTests(timeout_s=3)
    completions = [
        "Here:\n```python\ndef f(x):\n    return 2 * x\n```",  # 3 pass, g undefined: an exception
        "def f(x):\n    return x + 2",  # f(0), f(-1) wrong; g: an exception
        "def f(x) return 2x",  # does not compile
        "import sys\nsys.exit(0)",  # exits while the code runs: nothing reported
        "print('0 passed')\nimport time\ntime.sleep(60)",  # prints a forged line, then hangs
        "",
    ]
    assert score(reward, task, *completions) == [0.75, 0.25, 0.0, 0.0, 0.0, 0.0]
    assert reward.batch_metrics() == {"error": 4.0, "exception": 2.0, "no_code": 4.0, "passed": 4.0,
                                      "syntax": 4.0, "timeout": 4.0, "wrong": 2.0}
    batch = RolloutBatch(prompts=(task,), group_size=2, prompt_ids=torch.zeros(2, 1, dtype=torch.long),
                         prompt_mask=torch.ones(2, 1, dtype=torch.bool),
                         completion_ids=torch.zeros(2, 1, dtype=torch.long),
                         completion_mask=torch.ones(2, 1, dtype=torch.bool),
                         is_truncated=torch.zeros(2, dtype=torch.bool), texts=tuple(completions[:2]))
    out = WeightedSum([reward])(batch)
    assert out.metrics == {"reward/code_tests/exception": 2.0, "reward/code_tests/passed": 4.0,
                           "reward/code_tests/wrong": 2.0}


@needs_sandbox
def test_reports_survive_prints_a_hang_keeps_what_came_before_and_arguments_are_fresh():
    task = Prompt("q", metadata={"tests": [
        "assert f([]) == 1", "assert f([]) == 1", {"fn": "f", "args": [[5]], "expected": 2},
        "assert f(None) == 0", "assert f([1, 2]) == 3"]})
    chatty = ("import os, sys, time\nprint('garbage', end='')\nsys.stderr.write('noise')\n"
              "def f(items):\n    print('1 passed', end='')\n    os.write(1, b'x')\n"
              "    if items is None:\n        time.sleep(60)\n    items.append(0)\n    return len(items)\n")
    reward = CodeTests(timeout_s=2)
    # f(None) hangs until the program is stopped: f([1, 2]) never runs
    assert score(reward, task, chatty) == [pytest.approx(0.6)]
    assert reward.batch_metrics() == {"passed": 3.0, "timeout": 2.0}


@needs_sandbox
def test_the_checks_the_asserts_convert_to():
    task = Prompt("q", metadata={"tests": [
        "assert even(2)", "assert not even(3)", "assert find([1], 5) is None", "assert pair() == (1, 'a')",
        "assert abs(third() - 0.3333) < 1e-3", "assert math.isclose(third(), 0.3333333333333333)",
        "assert third() == 0.3333333333333333", "assert even(x=4) == True", "assert find([1, 2], 2) == 1",
        "assert big() == 1e999", {"fn": "table", "expected": {"a": [1, 2]}}]})
    honest = ("def even(x):\n    return x % 2 == 0\n"
              "def find(xs, v):\n    return xs.index(v) if v in xs else None\n"
              "def pair():\n    return (1, 'a')\ndef third():\n    return 1 / 3\n"
              "def big():\n    return float('inf')\ndef table():\n    return {'a': (1, 2)}\n")
    sloppy = ("def even(x):\n    return 'yes' if x % 2 == 0 else ''\ndef find(xs, v):\n    return -1\n"
              "def pair():\n    return [1, 'a']\ndef third():\n    return 0.33\n"
              "def big():\n    return 1e308\ndef table():\n    return {1: [1, 2]}\n")
    reward = CodeTests(timeout_s=5)
    assert score(reward, task, honest, sloppy) == [1.0, pytest.approx(3 / 11)]
    assert reward.batch_metrics() == {"passed": 14.0, "unserialisable": 1.0, "wrong": 7.0}
    # sloppy passes: 'yes' is truthy, '' falsy, a list is a tuple (both JSON arrays); even(x=4) == True
    # is not; a dict with an int key is no JSON object: unserialisable


@needs_sandbox
def test_a_tolerance_is_opt_in():
    task = Prompt("q", metadata={"tests": ["assert f() == [0.3, 1]", {"fn": "f", "expected": [0.3, 1.0]}]})
    code = "def f():\n    return [0.1 + 0.2, 1]"
    assert score(CodeTests(timeout_s=5), task, code) == [0.0]
    assert score(CodeTests(timeout_s=5, rel_tol=1e-9, abs_tol=1e-9), task, code) == [1.0]


# -- stdin / stdout --------------------------------------------------------------------------------------

@needs_sandbox
def test_stdin_stdout_tests_compare_the_output_here():
    task = Prompt("Print the double of each number.", metadata={"tests": [
        {"input": "2\n3\n", "output": "4\n6\n"}, {"input": "0\n", "output": "0"},
        {"input": "-1\n", "output": "-2\n", "testtype": "stdin"}]})
    honest = "import sys\nfor line in sys.stdin:\n    print(int(line) * 2, end='  \\r\\n')\nprint()\nprint()"
    reward = CodeTests(timeout_s=5)
    assert score(reward, task, honest, "print(0)", "print(' 0')", "print('4\\n6')\nraise SystemExit(1)",
                 "print(") == [1.0, pytest.approx(1 / 3), 0.0, 0.0, 0.0]
    assert reward.batch_metrics() == {"error": 3.0, "passed": 4.0, "syntax": 3.0, "wrong": 5.0}
    floats = Prompt("q", metadata={"tests": [{"input": "", "output": "0.3 x\n"}]})
    assert score(reward, floats, "print(0.1 + 0.2, 'x')") == [0.0]
    assert score(CodeTests(timeout_s=5, rel_tol=1e-9), floats, "print(0.1 + 0.2, 'x')") == [1.0]


@needs_sandbox
def test_expected_values_never_enter_the_sandbox(monkeypatch):
    sent = []

    def spy(program, **kwargs):
        sent.append(program + kwargs.get("stdin", ""))
        return real(program, **kwargs)

    real = code_module.run_python
    monkeypatch.setattr(code_module, "run_python", spy)
    task = Prompt("q", metadata={"tests": [
        "assert f('in') == 'EXPECTED-ON-THE-HOST'", {"fn": "f", "args": ["in"], "expected": 987654321},
        {"input": "in", "output": "OUTPUT-ON-THE-HOST"}]})
    both = "def f(x):\n    return x\nprint(input() if __name__ == '__main__' else '')"
    assert score(CodeTests(timeout_s=5), task, both) == [pytest.approx(0.0)]
    secrets = ("EXPECTED-ON-THE-HOST", "987654321", "OUTPUT-ON-THE-HOST")
    assert len(sent) == 2 and "'in'" in sent[0]  # the harness's call arguments, the stdio run's input
    assert not any(secret in text for text in sent for secret in secrets)


# -- conversion and refusal (no sandbox) -----------------------------------------------------------------

@pytest.mark.parametrize("source,case", [
    ("assert f(2) == 4", CallCase("f", "(2,)", "{}", "==", 4)),
    ("assert 4 == f(2), 'doubles'", CallCase("f", "(2,)", "{}", "==", 4)),
    ("assert f([1, (2, 3)], k={'a': -1}) == (1, None)",
     CallCase("f", "([1, (2, 3)],)", "{'k': {'a': -1}}", "==", [1, None])),
    ("assert f({1, 2}, b'x') == {'k': [1.5]}", CallCase("f", "({1, 2}, b'x')", "{}", "==", {"k": [1.5]})),
    ("assert f()", CallCase("f", "()", "{}", "truthy")),
    ("assert not f(0)", CallCase("f", "(0,)", "{}", "falsy")),
    ("assert f(0) is None", CallCase("f", "(0,)", "{}", "is", None)),
    ("assert f(0) is False", CallCase("f", "(0,)", "{}", "is", False)),
    ("assert abs(f(2) - 1.41) < 0.01", CallCase("f", "(2,)", "{}", "==", 1.41, 0.0, 0.01)),
    ("assert abs(1.41 - f(2)) <= 1e-2", CallCase("f", "(2,)", "{}", "==", 1.41, 0.0, 0.01)),
    ("assert math.isclose(f(2), 1.41)", CallCase("f", "(2,)", "{}", "==", 1.41, 1e-9, 0.0)),
    ("assert isclose(1.41, f(2), abs_tol=0.1)", CallCase("f", "(2,)", "{}", "==", 1.41, 1e-9, 0.1)),
])
def test_asserts_convert_to_call_cases(source, case):
    assert from_assert(source) == case


@pytest.mark.parametrize("source,why", [
    ("assert f(x) == 4", "`x` is not a literal"),
    ("assert f(2) == g(2)", "`g(2)` is not a literal"),
    ("assert f(2) == {1, 2}", "not plain JSON data"),
    ("assert f(2) == {1: 'a'}", "not plain JSON data"),
    ("assert sorted(f([3, 1])) == [1, 3]", "`f([3, 1])` is not a literal (in `sorted(f([3, 1]))`)"),
    ("assert f(x) + 1 == 4", "`x` is not a literal (in `f(x)`): a checked call's arguments are literals"),
    ("assert f(2) != 4", "none of the forms"),
    ("assert f(2) == 4 == g(2)", "none of the forms"),
    ("assert Solution().f(2) == 4", "none of the forms"),
    ("assert f(*[2]) == 4", "`*[2]` is not a literal"),
    ("assert f(2) == 4\nassert f(3) == 6", "not one assert statement"),
    ("def check(candidate):\n    assert candidate(2) == 4", "not one assert statement"),
    ("assert f(2) ==", "does not parse"),
    ("assert abs(f(2) - 1.4) < -1", "not a finite number >= 0"),
])
def test_asserts_that_cannot_be_checked_on_the_host_are_refused(source, why):
    with pytest.raises(CaseError, match=re.escape(why)):
        from_assert(source)


def test_check_names_the_test_the_rule_and_the_fix():
    reward = CodeTests()
    assert reward.check(DOUBLE) is None
    task = Prompt("q", metadata={"tests": ["assert f(2) == 4", "assert set(f(1)) == {1}",
                                           {"fn": "f", "args": [1]}, {"input": "1", "output": 2},
                                           {"fn": "f", "expected": 1, "timeout": 3}, 7]})
    message = reward.check(task)
    for part in ("tests[1] 'assert set(f(1)) == {1}'", "`f(1)` is not a literal", "tests[2]",
                 "needs \"expected\"", "tests[3]", "\"output\" strings", "tests[4]",
                 "unknown keys ['timeout']", "tests[5] '7'",
                 "assert f(<literals>) == <literal>", "allow_in_sandbox_asserts=True", "forge"):
        assert part in message, part
    assert "tests[0]" not in message
    assert "non-empty list" in reward.check(Prompt("q")) and "non-empty list" in reward.check(
        Prompt("q", metadata={"tests": []}))
    with pytest.raises(ValueError, match="tests\\[1\\]"):
        reward.cases(task)
    assert CodeTests(allow_in_sandbox_asserts=True).check(Prompt("q", metadata={"tests": [
        "assert set(f(1)) == {1}"]})) is None


def test_call_and_stdio_tests_from_dicts():
    assert parse_case({"fn": "f", "args": [[1, 2], "a"], "kwargs": {"k": None}, "expected": [1, {"x": 2}],
                       "abs_tol": 1e-6}) == CallCase("f", "([1, 2], 'a')", "{'k': None}", "==", [1, {"x": 2}],
                                                     None, 1e-6)
    assert parse_case({"input": "1 2\n", "output": "3\n"}) == StdioCase("1 2\n", "3\n")
    for bad, why in (({"fn": "f", "args": [math.nan], "expected": 1}, "not all Python literals"),
                     ({"fn": "f x", "expected": 1}, "not a function name"),
                     ({"fn": "f", "expected": {1, 2}}, "not plain JSON data"),
                     ({"fn": "f", "expected": 1, "rel_tol": -1}, "finite number >= 0"),
                     ({"input": "1", "output": "2", "testtype": "functional"}, "only stdin tests")):
        with pytest.raises(CaseError, match=why):
            parse_case(bad)


def test_the_host_comparisons():
    assert values_match([1, "a", None, {"k": True}], [1, "a", None, {"k": True}])
    assert values_match(4.0, 4) and values_match(1, True)  # as Python's == (the assert) says
    assert not values_match(0.1 + 0.2, 0.3) and values_match(0.1 + 0.2, 0.3, 1e-9)
    assert not values_match([0.3, "a"], [0.3, "b"], 1e-9) and not values_match([0.3], [0.3, 1], 1e-9)
    assert not values_match(math.nan, math.nan) and values_match(math.inf, math.inf, 1e-9)
    assert values_match(10 ** 400, 10 ** 400, 1e-9) and not values_match({"a": 1}, {"b": 1}, 1e-9)
    assert outputs_match("a b  \r\n c\t\n\n\n", "a b\n c") and not outputs_match("a\n\nb", "a\nb")
    assert not outputs_match(" a", "a") and not outputs_match("a  b", "a b")
    assert outputs_match("a  b", "a b", 1e-9) and outputs_match("1.0000000001", "1", 1e-9)
    assert not outputs_match("1.01", "1", 1e-9) and not outputs_match("x", "y", 1.0)


def test_the_tolerance_and_the_tests_are_checked():
    with pytest.raises(ValueError, match="rel_tol=-0.1 must be a finite number >= 0"):
        CodeTests(rel_tol=-0.1)
    with pytest.raises(Exception, match="tests\\[0\\]"):  # scoring a task that cannot be read fails loudly
        CodeTests()([Prompt("q", metadata={"tests": ["x = 1"]})], ["def f(): pass"])
