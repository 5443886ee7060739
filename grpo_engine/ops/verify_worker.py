"""A math-verify worker process (started by :class:`grpo_engine.ops.verify_pool.VerifyPool`).

It reads ``{"id", "gold", "answer"}`` JSON lines on stdin and writes ``{"id", "equal", "error"}`` lines
on stdout: ``equal`` is whether the answer equals the gold answer (math-verify, both parsed the same
way), ``error`` says why it could not tell. math-verify runs in this process's main thread, so its
own ``signal.alarm`` timeouts work, and a parse that runs away anyway is killed with the process (its
address space is capped at 2 GiB, so a parse that swells fails with ``MemoryError`` first).
It loads ``answers.py`` by its path, without the ``grpo_engine`` package (no torch in the worker).
"""

import importlib.util
import json
import sys
from pathlib import Path

MEMORY_LIMIT = 2 << 30  # bytes of address space: math-verify needs ~0.3 GB; a runaway parse stops here


def _answers():
    spec = importlib.util.spec_from_file_location("grpo_engine_answers",
                                                  Path(__file__).with_name("answers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cap_memory() -> None:
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT if hard < 0 else min(MEMORY_LIMIT, hard), hard))
    except (ImportError, ValueError, OSError):  # not on this platform: the pool's timeout still holds
        pass


def main() -> None:
    _cap_memory()
    answers = _answers()
    for line in sys.stdin:
        task = json.loads(line)
        out = {"id": task["id"], "equal": None, "error": None}
        try:
            gold = answers.parse_answer(task["gold"])
            if not gold:
                out["error"] = "gold"  # the reference answer does not parse
            else:
                out["equal"] = answers.verify_parsed(gold, answers.parse_answer(task["answer"]))
        except Exception as exc:
            # any error, MemoryError and math-verify's own included: this answer cannot be verified
            out["error"] = f"{type(exc).__name__}: {exc}"[:200]
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
