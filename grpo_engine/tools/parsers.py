"""Reading tool calls out of a model's turn, one parser per template family.

``ToolCallParser`` is the protocol: ``parse(text)`` returns the calls of a turn in order, each
``{"name": str, "arguments": dict}`` or, for a call that cannot be read, ``{"name": None, "error": why}``
(the model is told why, and it counts in ``tools/errors``). ``stop_text`` is the text that closes a
call: the rollout ends the model's turn there, before it can go on to write the tool's answer itself
(a parser whose calls no fixed text closes sets it None and defines ``call_closed(turn_text) -> bool``
instead). ``system_prompt(schemas)`` describes the tools for a chat template that does not render them.

:class:`HermesParser` reads the Hermes / Qwen format, ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (Qwen2.5, Qwen3, Hermes, and SmolLM2 once it is shown the format).
:class:`CodeBlockParser` reads tool-integrated reasoning's format (ToRA's): a fenced Python block is a
call to the ``python`` tool, and its output comes back as the tool's message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["ToolCallParser", "HermesParser", "CodeBlockParser"]


@runtime_checkable
class ToolCallParser(Protocol):
    """Reads the tool calls of a turn (see the module docstring)."""

    stop_text: str | None

    def parse(self, text: str) -> list[dict[str, Any]]:
        """The calls in ``text``, in order (none: the model answered)."""
        ...

    def system_prompt(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """A system message that shows the tools and how to call them."""
        ...


class HermesParser:
    """``<tool_call>{json}</tool_call>`` calls, Qwen's and Hermes's format.

    Example:
        >>> HermesParser().parse('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
        [{'name': 'add', 'arguments': {'a': 1}}]
        >>> HermesParser().parse("<tool_call>add(1)</tool_call>")[0]["name"] is None
        True
    """

    open_tag, stop_text = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> list[dict[str, Any]]:
        pattern = re.escape(self.open_tag) + r"(.*?)(?:" + re.escape(self.stop_text) + r"|$)"
        return [self._call(body) for body in re.findall(pattern, text, flags=re.DOTALL)]

    @staticmethod
    def _call(body: str) -> dict[str, Any]:
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return {"name": None, "error": f"the tool call is not valid JSON ({exc.msg}); write "
                                           '{"name": ..., "arguments": {...}}'}
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return {"name": None,
                    "error": 'a tool call needs a "name" string: {"name": ..., "arguments": {...}}'}
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return {"name": None, "error": f'the "arguments" of {call["name"]!r} must be a JSON object'}
        return {"name": call["name"], "arguments": arguments}

    def system_prompt(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        tools = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        return ("You may call one or more functions to help with the user's question.\n\n"
                f"The functions you may call, one JSON schema per line:\n<tools>\n{tools}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and arguments between tags:\n"
                f'{self.open_tag}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
                f"{self.stop_text}")


class CodeBlockParser:
    """A fenced Python block (```python ... ```) is a call to one tool, the block its code argument.

    Args:
        tool: the tool called (default the ``python`` tool's name).
        argument: the tool's parameter that receives the code.

    Example:
        >>> parser = CodeBlockParser()
        >>> parser.parse("Let me compute.\\n```python\\nprint(3 * 4)\\n```")
        [{'name': 'python', 'arguments': {'code': 'print(3 * 4)\\n'}}]
        >>> parser.call_closed("```python\\nprint(1)"), parser.call_closed("```python\\nprint(1)\\n```")
        (False, True)
    """

    stop_text = None
    _block = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)

    def __init__(self, tool: str = "python", argument: str = "code") -> None:
        self.tool, self.argument = tool, argument

    def call_closed(self, text: str) -> bool:
        """Whether ``text`` holds a whole Python block (the turn ends at its closing fence)."""
        return self._block.search(text) is not None

    def parse(self, text: str) -> list[dict[str, Any]]:
        return [{"name": self.tool, "arguments": {self.argument: code}} for code in self._block.findall(text)]

    def system_prompt(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        return ("To run Python, write the program in a ```python block; what it prints is shown to you "
                "next. Print every value you need.")
