"""Tools: plain Python functions the model may call, their schemas, and calling them within limits.

- A tool is a function with type hints and a Google-style docstring (``Args:``); its JSON schema comes
  from ``transformers.utils.get_json_schema``, the one ``apply_chat_template(tools=...)`` renders, so
  the model sees what the tokenizer's own template shows for it. An ``async def`` tool is awaited (in
  its call's own thread, with its own event loop) and cancelled at its time limit.
- An environment (``environment_factory``) contributes its public methods, bound to the row's instance.
  One environment's methods (``reset`` included) never run at the same time: each call holds the
  environment's lock (:func:`environment_lock`, one per object, also where several rows share it).
- :func:`call_tools` runs one turn's calls: the calls of a row one after another (an environment's
  state changes in the order the model asked), the rows side by side in threads. Each call has a
  time limit, its wait for the environment's lock included. A call still running after it is reported
  as timed out and its result, or its error, is dropped whenever it comes; Python cannot stop a
  thread, so a sync call finishes, or not, in the background, holding its environment's lock: no other
  call of that environment starts before it ends, and one that waits past its own limit never starts.
  After an environment's call timed out, the row's later calls are not made (the sampler ends that
  rollout). Run code in :func:`grpo_engine.sandbox.run_python`, which is stopped for real. A call that
  raises is reported with its exception; a result longer than ``max_chars`` is cut, and the cut is
  said in the message the model reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["Tool", "ToolResult", "as_tool", "environment_tools", "environment_lock", "reset_environment",
           "call_tools"]


@dataclass(frozen=True)
class Tool:
    """A callable the model may use, with the schema its chat template renders.

    Attributes:
        name: the name the model calls it by.
        fn: the function (or bound method).
        schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``.
        lock: the lock of the environment whose method ``fn`` is (:func:`environment_lock`), held by each
            call; None for a plain function (calls of it may run side by side).
    """

    name: str
    fn: Callable[..., Any]
    schema: Mapping[str, Any]
    lock: Any = None


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
    """The public methods of ``environment`` (not ``reset`` or ``get_reward``, nothing starting with ``_``)
    as tools, in the order the class defines them (TRL's ``environment_factory`` shape: ``get_reward`` scores
    the rollout, so the model never calls it)."""
    cls = type(environment)
    names = [n for n in dict.fromkeys(n for k in reversed(cls.__mro__) for n in vars(k))
             if not n.startswith("_") and n not in ("reset", "get_reward")
             and inspect.isfunction(getattr(cls, n, None))]
    lock = environment_lock(environment)
    return [dataclasses.replace(as_tool(getattr(environment, n)), lock=lock) for n in names]


_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


def environment_lock(environment: object) -> threading.Lock:
    """The one lock of ``environment`` (by identity): every call of its methods, and its ``reset``, holds
    it, so they never run at the same time, also when an ``environment_factory`` hands the same object
    to several rows."""
    key = id(environment)
    with _locks_guard:
        lock = _locks.get(key)
        if lock is None:
            lock = _locks[key] = threading.Lock()
            try:  # forgotten with the object (an object without weak references keeps its entry)
                weakref.finalize(environment, _locks.pop, key, None)
            except TypeError:
                pass
        return lock


def reset_environment(environment: object, prompt: Any, *, timeout_s: float | None = None) -> str | None:
    """Calls ``environment.reset`` with the prompt's fields it accepts (``prompt``, ``target`` and each
    metadata column; all of them to a ``**kwargs``), holding the environment's lock (waited for at most
    ``timeout_s``), awaits it if it is ``async``, and returns its text observation, or None.

    Raises:
        RuntimeError: the environment is still busy past ``timeout_s`` (a call of it that timed out
            still runs: the factory handed out an object in use).
    """
    reset = getattr(environment, "reset", None)
    if reset is None:
        return None
    fields = {"prompt": prompt.content, "target": prompt.target, **prompt.metadata}
    params = inspect.signature(reset).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        fields = {k: v for k, v in fields.items() if k in params}
    lock = environment_lock(environment)
    if not lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
        raise RuntimeError(f"{type(environment).__name__}.reset: the environment is still busy with a call "
                           "that timed out; let environment_factory return a new object for each rollout")
    try:
        observation = reset(**fields)
        if inspect.isawaitable(observation):
            observation = _await_in_thread(observation)
    finally:
        lock.release()
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


class _Late(Exception):
    """An async call's time limit passed: it was cancelled."""


async def _bounded(awaitable: Any, seconds: float | None) -> Any:
    """The awaitable's value; cancelled, raising ``_Late``, after ``seconds`` (None: no limit)."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=None if seconds is None else max(seconds, 0.0))
    if not done:
        task.cancel()
        raise _Late
    return task.result()


def _await_in_thread(awaitable: Any) -> Any:
    """The awaitable's value, run to its end on an event loop of a thread of its own (the caller's thread
    may already run a loop, as a notebook's does)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = asyncio.run(_bounded(awaitable, None))
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, name="await-reset", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclasses.dataclass
class _Outcome:
    """One call's state, shared by the caller and the call's thread under ``guard``: ``waiting`` (for the
    environment's lock), ``running``, ``done`` (``result`` set) or ``abandoned`` (the caller stopped waiting:
    a call not yet started never starts, a late result or error is dropped)."""

    guard: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    state: str = "waiting"
    result: tuple[str, Any] = ("late", None)


def _run(tool: Tool, arguments: Mapping[str, Any], deadline: float, outcome: _Outcome) -> None:
    """The call's thread: waits for the environment's lock until ``deadline``, runs the call (awaited and
    cancelled at ``deadline`` if it is async), and hands its result over unless the caller gave up."""
    if tool.lock is not None and not tool.lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
        return  # the environment is still busy: this call never starts
    try:
        with outcome.guard:
            if outcome.state == "abandoned":
                return
            outcome.state = "running"
        try:
            value = tool.fn(**arguments)
            if inspect.isawaitable(value):
                value = asyncio.run(_bounded(value, deadline - time.monotonic()))
            result: tuple[str, Any] = ("value", value)
        except _Late:
            result = ("late", None)
        except BaseException as exc:  # reported to the model
            result = ("error", exc)
        with outcome.guard:
            if outcome.state == "running":
                outcome.state, outcome.result = "done", result
    finally:
        if tool.lock is not None:
            tool.lock.release()


def _call(tools: Mapping[str, Tool], call: Mapping[str, Any], timeout_s: float, max_chars: int) -> ToolResult:
    """One call within ``timeout_s`` (its wait for its environment included), its result cut to
    ``max_chars``."""
    name = call.get("name")
    if name is None:
        return ToolResult(f"Error: {call.get('error', 'the tool call could not be read')}", "error")
    if name not in tools:
        return ToolResult(f"Error: there is no tool named {name!r}; the tools are {', '.join(tools)}",
                          "error")
    outcome = _Outcome()
    thread = threading.Thread(target=_run, args=(tools[name], call.get("arguments", {}),
                                                 time.monotonic() + timeout_s, outcome),
                              name=f"tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with outcome.guard:
        if outcome.state != "done":
            outcome.state = "abandoned"  # not started: it never starts; running: its result is dropped
        kind, value = outcome.result
    if kind == "late":
        return ToolResult(f"Error: the tool {name!r} did not return within {timeout_s:g} s", "timeout")
    if kind == "error":
        return ToolResult(f"Error: {type(value).__name__}: {value}"[:max_chars], "error")
    text = _text(value)
    if len(text) > max_chars:
        return ToolResult(text[:max_chars] + f"\n[cut: {len(text)} characters in all]", "ok", cut=True)
    return ToolResult(text)


def ends_rollout(tools: Mapping[str, Tool], call: Mapping[str, Any], result: ToolResult) -> bool:
    """Whether ``result`` is a timed-out call of an environment's method: its environment may still be
    changing, so the rollout makes no more calls and ends."""
    tool = tools.get(call.get("name") or "")
    return result.status == "timeout" and tool is not None and tool.lock is not None


def call_tools(calls: Sequence[tuple[Mapping[str, Tool], Sequence[Mapping[str, Any]]]], *, timeout_s: float,
               max_chars: int, workers: int = 8) -> list[list[ToolResult]]:
    """The results of each row's calls: ``calls`` holds, per row, its tools by name and its parsed
    calls; a row's calls run in order, rows side by side (``workers`` at a time). After a call of an
    environment's method timed out (:func:`ends_rollout`), the row's later calls are not made."""
    def row(job: tuple[Mapping[str, Tool], Sequence[Mapping[str, Any]]]) -> list[ToolResult]:
        tools, asked = job
        results: list[ToolResult] = []
        for call in asked:
            if results and ends_rollout(tools, asked[len(results) - 1], results[-1]):
                stopped = ToolResult("Error: not run: an earlier call of the environment timed out", "error")
                return results + [stopped] * (len(asked) - len(results))
            results.append(_call(tools, call, timeout_s, max_chars))
        return results

    if len(calls) <= 1:
        return [row(job) for job in calls]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(calls)))) as pool:
        return list(pool.map(row, calls))
