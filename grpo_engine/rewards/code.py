"""CodeTests: run a completion's code against its task's tests in the sandbox; the score is the
fraction of tests passed.

A code task is a prompt whose metadata holds ``tests``, a list of Python snippets (``assert f(2) == 4``),
e.g. a JSONL line ``{"question": "Write f(x) that doubles x.", "tests": ["assert f(2) == 4"]}`` read by
``load_jsonl_prompts(path, answer_field=None)``. The code is the completion's last fenced block
(```python ... ```, or any fence), else the whole completion. One sandboxed process per completion
(:func:`grpo_engine.sandbox.run_python`): a harness compiles the code, runs it, then runs each test in
the code's namespace and reports each result on its own line, keyed by a random token it read from
stdin (so a program that merely prints "pass", or exits early with status 0, passes nothing).

Every outcome is counted in the step's log as ``reward/<name>/<kind>``: ``passed``, ``assertion`` (a
test's assert failed), ``exception`` (a test raised something else), ``syntax`` (the code does not
compile), ``error`` (running the code itself raised, or exited), ``no_code`` (an empty completion),
and the sandbox's stop reasons (``timeout``, ``cpu``, ``memory``, ``output``, ``processes``, ...) for the
tests a stopped program never reported. The harness lives in the same process as the code: a program
that inspects the harness (its frames, ``__main__``) could forge results; the sandbox keeps it from
harming anything, but this score is not proof against a policy that learns to read the harness.
"""

from __future__ import annotations

import json
import re
import secrets
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from grpo_engine.rewards.base import Reward
from grpo_engine.sandbox import run_python
from grpo_engine.types import Prompt

__all__ = ["CodeTests", "extract_code"]

_HARNESS = """
import json, sys
_token, _tests, _code = sys.stdin.readline().strip(), json.loads(sys.stdin.readline()), sys.stdin.read()
try:
    _compiled = compile(_code, "solution.py", "exec")
except (SyntaxError, ValueError):
    print(_token, "code", "syntax", flush=True)
    raise SystemExit(0)
_space = {"__name__": "solution"}
try:
    exec(_compiled, _space)
except BaseException:
    print(_token, "code", "error", flush=True)
    raise SystemExit(0)
for _i, _test in enumerate(_tests):
    try:
        exec(_test, _space)
        _kind = "passed"
    except AssertionError:
        _kind = "assertion"
    except BaseException:
        _kind = "exception"
    print(_token, _i, _kind, flush=True)
"""

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


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
        timeout_s, memory_mb: the sandbox's limits for one completion's program (all its tests).
        workers: programs run side by side.

    Example:
        >>> # CodeTests()([Prompt("Write f(x) = 2x.", metadata={"tests": ["assert f(2) == 4"]})],
        >>> #             ["def f(x):\\n    return 2 * x"])
        >>> # tensor([1.])
    """

    def __init__(self, weight: float = 1.0, name: str | None = None, *, timeout_s: float = 10.0,
                 memory_mb: int = 512, workers: int = 2) -> None:
        super().__init__(weight, name)
        self.timeout_s, self.memory_mb, self.workers = timeout_s, memory_mb, workers
        self._counts: Counter[str] = Counter()

    def check(self, prompt: Prompt) -> str | None:
        tests = prompt.metadata.get("tests")
        if not isinstance(tests, (list, tuple)) or not tests or not all(isinstance(t, str) for t in tests):
            return (f"metadata 'tests' is {tests!r}; a code task needs a non-empty list of Python snippets, "
                    "e.g. \"tests\": [\"assert f(2) == 4\"]")
        return None

    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            outcomes = list(pool.map(self._outcomes, prompts, completions))
        self._counts = Counter(kind for kinds in outcomes for kind in kinds)
        return [kinds.count("passed") / len(kinds) for kinds in outcomes]

    def batch_metrics(self) -> dict[str, float]:
        """How many tests met each outcome in the last batch scored (see the module docstring)."""
        return {kind: float(count) for kind, count in sorted(self._counts.items())}

    def _outcomes(self, prompt: Prompt, completion: str) -> list[str]:
        """The outcome of each of ``prompt``'s tests on ``completion``'s code."""
        tests = list(prompt.metadata.get("tests") or ())
        code = extract_code(completion)
        if not code.strip():
            return ["no_code"] * len(tests)
        token = secrets.token_hex(16)
        result = run_python(_HARNESS, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            stdin=f"{token}\n{json.dumps(tests)}\n{code}")
        kinds: dict[int, str] = {}
        for line in result.stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == token:
                if parts[1] == "code":
                    return [parts[2]] * len(tests)
                if parts[1].isdigit() and int(parts[1]) < len(tests):
                    kinds.setdefault(int(parts[1]), parts[2])
        missing = result.stopped or "error"  # a test never reported: the program was stopped, or exited
        return [kinds.get(i, missing) for i in range(len(tests))]
