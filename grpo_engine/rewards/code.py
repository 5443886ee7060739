"""CodeTests: run a completion's code in the sandbox; the host compares what it returned or printed with
the task's expected values, which never enter the sandbox. The score is the fraction of tests passed.

A code task's ``metadata["tests"]`` lists its tests (:mod:`grpo_engine.rewards.code_cases`): call tests
``{"fn": "f", "args": [2], "expected": 4}``, stdin/stdout tests ``{"input": "2\\n", "output": "4\\n"}``,
and asserts ``"assert f(2) == 4"``, converted into call tests by parsing (``check`` refuses one it cannot
convert, unless ``allow_in_sandbox_asserts``). The code is the completion's last fenced block, else the
whole completion. Call tests: one sandboxed program (:func:`grpo_engine.sandbox.run_python`) runs the code,
then each call with fresh arguments, and writes each returned value as JSON of plain data (a custom
``__eq__``, a subclass: ``unserialisable``) on a descriptor of its own (the code's prints go to
/dev/null); the host parses the lines and compares. Stdin/stdout tests: one program per test, its
stdout compared here. Guaranteed: a test passes only if the host's comparison succeeds, so nothing the
program prints, returns, patches or exits with passes a test whose expected value it did not produce.
Not guaranteed: the harness shares the program's process, so the program decides what is reported for
each call (it can fail any call, or mislabel its own failure); a value that can be guessed (a bool, or
one in the prompt) can be passed by guessing; calls run in order in one process and share its state;
asserts run in the sandbox (opt-in) report their own result and can be forged.

Each outcome is counted as ``reward/<name>/<kind>``: ``passed``, ``wrong`` (a value or output that differs),
``exception`` (a call raised), ``unserialisable``, ``assertion`` (an in-sandbox assert failed),
``syntax``, ``error`` (running the code raised or exited, a nonzero exit status, a result never reported,
a garbled or repeated report), ``no_code``, and the sandbox's stop reasons (``timeout``, ``memory``, ...).
"""

from __future__ import annotations

import json
import re
import secrets
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpo_engine.rewards.base import Reward, excerpt
from grpo_engine.rewards.code_cases import (
    FIX,
    AssertCase,
    CallCase,
    Case,
    CaseError,
    StdioCase,
    outputs_match,
    parse_case,
    values_match,
)
from grpo_engine.sandbox import SandboxResult, run_python
from grpo_engine.types import Prompt

__all__ = ["CodeTests", "extract_code"]

_HARNESS = (Path(__file__).parent / "code_harness.py").read_text(encoding="utf-8")

_STDIO = """import sys
try:
    _code = compile({source!r}, "solution.py", "exec")
except (SyntaxError, ValueError, MemoryError, RecursionError):
    sys.stderr.write({marker!r})
    raise SystemExit(1)
exec(_code, dict(__name__="__main__"))
"""

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_REPORT = re.compile(r"([0-9a-f]{32}) (code|[0-9]{1,9}) ([a-z]{1,20})(?: (.*))?")


def extract_code(completion: str) -> str:
    """The last fenced code block of ``completion``, else the whole text.

    Example:
        >>> extract_code("Here:\\n```python\\ndef f(x):\\n    return 2 * x\\n```")
        'def f(x):\\n    return 2 * x\\n'
    """
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeTests(Reward):
    """The fraction of the task's tests the completion's code passes (see the module docstring).

    Args:
        weight, name: as every reward.
        timeout_s, memory_mb: the sandbox's limits for one program: the one running all of a completion's
            call tests (a call that runs past it ends that call and every later one as the stop reason,
            ``timeout`` or ``cpu``), or one stdin/stdout test.
        workers: completions scored side by side.
        rel_tol, abs_tol: float tolerance of every comparison (``math.isclose``; 0, 0: exact); a test's own
            (``"rel_tol"``, ``"abs_tol"``, ``math.isclose``, ``abs(...) < eps``) wins.
        max_output_bytes: a program's output (the results and stderr; a script's stdout and stderr)
            before it is stopped.
        allow_in_sandbox_asserts: run an assert that cannot be converted inside the sandbox, where the
            program can forge its result (without it, :meth:`check` refuses the task).

    Example:
        >>> # CodeTests()([Prompt("Write f(x) = 2x.", metadata={"tests": ["assert f(2) == 4"]})],
        >>> #             ["def f(x):\\n    return 2 * x"])
        >>> # tensor([1.])
    """

    def __init__(self, weight: float = 1.0, name: str | None = None, *, timeout_s: float = 10.0,
                 memory_mb: int = 512, workers: int = 2, rel_tol: float = 0.0, abs_tol: float = 0.0,
                 max_output_bytes: int = 1 << 20, allow_in_sandbox_asserts: bool = False) -> None:
        super().__init__(weight, name)
        for key, value in (("rel_tol", rel_tol), ("abs_tol", abs_tol)):
            if not 0 <= value < float("inf"):
                raise ValueError(f"CodeTests: {key}={value!r} must be a finite number >= 0 (0: exact)")
        self.timeout_s, self.memory_mb, self.workers = timeout_s, memory_mb, workers
        self.rel_tol, self.abs_tol, self.max_output_bytes = rel_tol, abs_tol, max_output_bytes
        self.allow_in_sandbox_asserts = allow_in_sandbox_asserts
        self._counts: Counter[str] = Counter()

    def cases(self, prompt: Prompt) -> list[Case]:
        """``prompt``'s tests as cases, else ValueError naming each test that cannot be read, the rule and
        the fix."""
        tests = prompt.metadata.get("tests")
        if not isinstance(tests, (list, tuple)) or not tests:
            raise ValueError(f"metadata 'tests' is {excerpt(tests)}; a code task needs a non-empty list of "
                             "tests, e.g. \"tests\": [\"assert f(2) == 4\"]")
        found, problems = [], []
        for index, test in enumerate(tests):
            try:
                found.append(parse_case(test, allow_asserts=self.allow_in_sandbox_asserts))
            except CaseError as error:
                problems.append(f"tests[{index}] {excerpt(test)}: {error}")
        if problems:
            raise ValueError(f"{'; '.join(problems)}. The host compares every result outside the sandbox: "
                             f"{FIX}")
        return found

    def check(self, prompt: Prompt) -> str | None:
        try:
            self.cases(prompt)
        except ValueError as error:
            return str(error)
        return None

    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        cases = [self.cases(prompt) for prompt in prompts]  # a task that cannot be read fails before any run
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            outcomes = list(pool.map(self._outcomes, cases, completions))
        self._counts = Counter(kind for kinds in outcomes for kind in kinds)
        return [kinds.count("passed") / len(kinds) for kinds in outcomes]

    def batch_metrics(self) -> dict[str, float]:
        """How many tests met each outcome in the last batch scored (see the module docstring)."""
        return {kind: float(count) for kind, count in sorted(self._counts.items())}

    def _outcomes(self, cases: list[Case], completion: str) -> list[str]:
        """The outcome of each case on ``completion``'s code."""
        code = extract_code(completion)
        if not code.strip():
            return ["no_code"] * len(cases)
        kinds = [""] * len(cases)
        stdio = [isinstance(case, StdioCase) for case in cases]
        for wanted, run in ((False, self._in_process), (True, self._stdio)):
            group = [i for i, flag in enumerate(stdio) if flag is wanted]
            if group:
                for index, kind in zip(group, run(code, [cases[i] for i in group]), strict=True):
                    kinds[index] = kind
        return kinds

    def _sandbox(self, program: str, stdin: str) -> SandboxResult:
        return run_python(program, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                          max_output_bytes=self.max_output_bytes, stdin=stdin)

    def _tolerance(self, case: CallCase | StdioCase) -> tuple[float, float]:
        return (self.rel_tol if case.rel_tol is None else case.rel_tol,
                self.abs_tol if case.abs_tol is None else case.abs_tol)

    def _in_process(self, code: str, cases: list[CallCase | AssertCase]) -> list[str]:
        """Call tests (and in-sandbox asserts) in one program; what it reported judged here."""
        token = secrets.token_hex(16)
        jobs = [{"assert": case.source} if isinstance(case, AssertCase)
                else {"fn": case.fn, "args": case.args, "kwargs": case.kwargs} for case in cases]
        result = self._sandbox(_HARNESS, f"{token}\n{json.dumps(jobs)}\n{json.dumps(code)}")
        reports, code_kind = _read_reports(result.stdout, token, len(cases))
        missing = result.stopped or code_kind or "error"  # the sandbox's own observation first
        return [self._judge(case, *reports[i]) if i in reports else missing for i, case in enumerate(cases)]

    def _judge(self, case: CallCase | AssertCase, kind: str, payload: str | None) -> str:
        """A reported result's outcome: only a returned value the host finds equal passes a call test."""
        if isinstance(case, AssertCase):
            return kind if kind in ("passed", "assertion", "exception") and payload is None else "error"
        if kind in ("exception", "unserialisable") and payload is None:
            return kind
        if kind != "returned" or payload is None:
            return "error"
        try:
            value = json.loads(payload)
        except (ValueError, RecursionError):
            return "error"
        if case.check == "==":
            same = values_match(value, case.expected, *self._tolerance(case))
        elif case.check == "is":
            same = value is case.expected
        else:
            same = bool(value) is (case.check == "truthy")
        return "passed" if same else "wrong"

    def _stdio(self, code: str, cases: list[StdioCase]) -> list[str]:
        """Stdin/stdout tests: the program once per test, its stdout compared here."""
        marker = f"{secrets.token_hex(16)} syntax"
        program = _STDIO.format(source=code, marker=f"\n{marker}\n")
        kinds: list[str] = []
        for case in cases:
            result = self._sandbox(program, case.input)
            if result.stopped is not None:
                kinds.append(result.stopped)
            elif result.exit_code != 0:
                kinds.append("syntax" if marker in result.stderr else "error")
            else:
                same = outputs_match(result.stdout, case.output, *self._tolerance(case))
                kinds.append("passed" if same else "wrong")
            if kinds[-1] == "syntax":  # it will not compile for the next input either
                return kinds + ["syntax"] * (len(cases) - len(kinds))
        return kinds


Report = tuple[str, str | None]  # (kind, payload)


def _read_reports(stdout: str, token: str, count: int) -> tuple[dict[int, Report], str | None]:
    """The harness's lines in ``stdout``: ``{index: (kind, payload)}`` (an index reported twice:
    ``("repeated", None)``, judged an error) and the code's own outcome (``syntax`` / ``error``), if any."""
    reports: dict[int, Report] = {}
    code_kind = None
    for line in stdout.split("\n"):
        match = _REPORT.fullmatch(line)
        if match is None or match[1] != token:
            continue
        if match[2] == "code":
            code_kind = code_kind or (match[3] if match[3] in ("syntax", "error") else "error")
        elif int(match[2]) < count:
            index = int(match[2])
            reports[index] = ("repeated", None) if index in reports else (match[3], match[4])
    return reports, code_kind
