"""Tools: plain Python functions the model may call, their schemas, and calling them within limits.

- A tool is a function with type hints and a Google-style docstring (``Args:``); its JSON schema comes
  from ``transformers.utils.get_json_schema``, the one ``apply_chat_template(tools=...)`` renders, so
  the model sees what the tokenizer's own template shows for it.
- An environment (``environment_factory``) contributes its public methods, bound to the row's instance.
- :func:`call_tools` runs one turn's calls: the calls of a row one after another (an environment's
  state changes in the order the model asked), the rows side by side in threads. Each call has a
  time limit: a call still running after it is reported as timed out and the row goes on (Python cannot
  stop a thread: it finishes, or not, in the background; run code in :func:`grpo_engine.sandbox.run_python`,
  which is stopped for real). A call that raises is reported with its exception; a result longer than
  ``max_chars`` is cut, and the cut is said in the message the model reads.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["Tool", "ToolResult", "as_tool", "environment_tools", "reset_environment", "call_tools"]


@dataclass(frozen=True)
class Tool:
    """A callable the model may use, with the schema its chat template renders.

    Attributes:
        name: the name the model calls it by.
        fn: the function (or bound method).
        schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``.
    """

    name: str
    fn: Callable[..., Any]
    schema: Mapping[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """What one call gave back.

    Attributes:
        content: the text the model reads (the result, or the error it met).
        status: ``"ok"``, ``"error"`` (raised, unknown tool, bad arguments, unparsable call) or ``"timeout"``.
        cut: the result was longer than the limit and was cut.
    """

    content: str
    status: str = "ok"
    cut: bool = False


def as_tool(fn: Callable[..., Any]) -> Tool:
    """``fn`` as a :class:`Tool`, its schema read from its type hints and docstring.

    Raises:
        ValueError: the schema cannot be built (a parameter without a type hint, a docstring without
            ``Args:``), with what to write.

    Example:
        >>> def multiply(a: int, b: int) -> int:
        ...     '''Multiplies two integers.
        ...
        ...     Args:
        ...         a: the first factor.
        ...         b: the second factor.
        ...     '''
        ...     return a * b
        >>> as_tool(multiply).schema["function"]["parameters"]["required"]
        ['a', 'b']
    """
    from transformers.utils import get_json_schema

    if isinstance(fn, Tool):
        return fn
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        schema = get_json_schema(fn)
    except Exception as exc:
        raise ValueError(f"tool {name!r}: its schema cannot be built from its signature and docstring "
                         f"({exc}); give every parameter a type hint and write a Google-style docstring "
                         "with a description and an 'Args:' section naming each parameter") from exc
    return Tool(schema["function"]["name"], fn, schema)


def environment_tools(environment: object) -> list[Tool]:
    """The public methods of ``environment`` (not ``reset``, nothing starting with ``_``) as tools, in
    the order the class defines them (TRL's ``environment_factory`` shape)."""
    cls = type(environment)
    names = [n for n in dict.fromkeys(n for k in reversed(cls.__mro__) for n in vars(k))
             if not n.startswith("_") and n != "reset" and inspect.isfunction(getattr(cls, n, None))]
    return [as_tool(getattr(environment, n)) for n in names]


def reset_environment(environment: object, prompt: Any) -> str | None:
    """Calls ``environment.reset`` with the prompt's fields it accepts (``prompt``, ``target`` and each
    metadata column; all of them to a ``**kwargs``), and returns its text observation, or None."""
    reset = getattr(environment, "reset", None)
    if reset is None:
        return None
    fields = {"prompt": prompt.content, "target": prompt.target, **prompt.metadata}
    params = inspect.signature(reset).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        fields = {k: v for k, v in fields.items() if k in params}
    observation = reset(**fields)
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"{type(environment).__name__}.reset returned {type(observation).__name__}; return "
                        "None, or a str the first user message ends with")
    return observation


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _call(tools: Mapping[str, Tool], call: Mapping[str, Any], timeout_s: float, max_chars: int) -> ToolResult:
    """One call within ``timeout_s``, its result cut to ``max_chars``."""
    name = call.get("name")
    if name is None:
        return ToolResult(f"Error: {call.get('error', 'the tool call could not be read')}", "error")
    if name not in tools:
        return ToolResult(f"Error: there is no tool named {name!r}; the tools are {', '.join(tools)}",
                          "error")
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = tools[name].fn(**call.get("arguments", {}))
        except BaseException as exc:  # reported to the model
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return ToolResult(f"Error: the tool {name!r} did not return within {timeout_s:g} s", "timeout")
    if "error" in box:
        error = box["error"]
        return ToolResult(f"Error: {type(error).__name__}: {error}"[:max_chars], "error")
    text = _text(box["value"])
    if len(text) > max_chars:
        return ToolResult(text[:max_chars] + f"\n[cut: {len(text)} characters in all]", "ok", cut=True)
    return ToolResult(text)


def call_tools(calls: Sequence[tuple[Mapping[str, Tool], Sequence[Mapping[str, Any]]]], *, timeout_s: float,
               max_chars: int, workers: int = 8) -> list[list[ToolResult]]:
    """The results of each row's calls: ``calls`` holds, per row, its tools by name and its parsed
    calls; a row's calls run in order, rows side by side (``workers`` at a time)."""
    def row(job: tuple[Mapping[str, Tool], Sequence[Mapping[str, Any]]]) -> list[ToolResult]:
        tools, asked = job
        return [_call(tools, call, timeout_s, max_chars) for call in asked]

    if len(calls) <= 1:
        return [row(job) for job in calls]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(calls)))) as pool:
        return list(pool.map(row, calls))
