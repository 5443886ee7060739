"""A ready ``python`` tool for tool-integrated reasoning: the model's program runs in the sandbox
(:func:`grpo_engine.sandbox.run_python`) and the model reads what it printed.

The tool refuses to be built where the sandbox cannot run (``SandboxUnavailable`` says what to
install), so a run never trains on "the sandbox is missing" answers. What the model reads: the
program's stdout, then, when it failed, the last lines of its stderr (the traceback) or why it was
stopped (``[stopped: timeout]``, ``memory``, ``output``, ...), cut to ``max_chars``.
"""

from __future__ import annotations

from grpo_engine.sandbox import SandboxUnavailable, run_python, sandbox_available
from grpo_engine.tools.functions import Tool, as_tool

__all__ = ["python_tool"]


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 512, max_chars: int = 2000) -> Tool:
    """The ``python`` tool: runs a program in the sandbox within ``timeout_s`` and ``memory_mb``.

    Keep ``timeout_s`` below the trainer's ``tool_timeout_s`` (the sandbox stops the program for real;
    the tool timeout only stops waiting for it).

    Raises:
        SandboxUnavailable: the sandbox cannot run on this machine.

    Example:
        >>> # python_tool().fn(code="print(123 * 456)")
        >>> # '56088'
    """
    why = sandbox_available()
    if why is not None:
        raise SandboxUnavailable(f"the python tool runs programs in the sandbox, which cannot run here: "
                                 f"{why}")

    def python(code: str) -> str:
        """Runs a Python program and returns what it printed. Print every value you need.

        Args:
            code: the whole program, e.g. "print(123 * 456)".
        """
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb)
        out = result.stdout
        if result.stopped is not None:
            out += f"\n[stopped: {result.stopped}]"
        elif result.exit_code != 0:
            out += "\n" + "\n".join(result.stderr.strip().splitlines()[-3:])
        out = out.strip() or "(the program printed nothing)"
        return out if len(out) <= max_chars else out[:max_chars] + "\n[cut]"

    return as_tool(python)
