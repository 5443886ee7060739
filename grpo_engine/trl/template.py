"""TRL's prompt rendering, as a :class:`~grpo_engine.data.templates.PromptTemplate`: a conversational
prompt (a list of messages) goes through the tokenizer's chat template with the generation prompt, and a
plain-text prompt is fed as it is (TRL applies no template to text; the native default wraps it in a user
turn). The sampler then tokenises the text as TRL does (special tokens added, a BOS the template wrote
not doubled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_engine.data.templates import ChatTemplate
from grpo_engine.types import Prompt

__all__ = ["TRLTemplate"]


@dataclass(frozen=True)
class TRLTemplate(ChatTemplate):
    """Messages through the chat template, text as it is (module docstring).

    Example:
        >>> TRLTemplate().render(Prompt("TL;DR: a long post"), tokenizer=None)
        'TL;DR: a long post'
    """

    def render(self, prompt: Prompt, tokenizer: Any) -> str:
        if isinstance(prompt.content, str):
            return prompt.content
        return super().render(prompt, tokenizer)
