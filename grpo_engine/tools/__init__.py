"""Multi-turn rollouts with tools and environments: :class:`ToolSampler`, the tool-call parsers, and a
ready ``python`` tool on the sandbox (:func:`python_tool`)."""

from grpo_engine.tools.functions import Tool, ToolResult, as_tool, call_tools, environment_tools
from grpo_engine.tools.parsers import CodeBlockParser, HermesParser, ToolCallParser
from grpo_engine.tools.python import python_tool
from grpo_engine.tools.rollout import ToolSampler

__all__ = ["Tool", "ToolResult", "as_tool", "call_tools", "environment_tools", "CodeBlockParser",
           "HermesParser", "ToolCallParser", "ToolSampler", "python_tool"]
