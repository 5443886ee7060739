"""Prompt templates: turn a ``Prompt`` into the exact text fed to the tokenizer.

Implemented:

* ``PromptTemplate``: the protocol, ``render(prompt, tokenizer) -> str``. The text includes the
  template's special tokens and ends with the generation prompt, so the sampler tokenises it as
  is and the completion starts right after it.
* ``ChatTemplate``: the tokenizer's own chat template (``apply_chat_template`` with
  ``add_generation_prompt=True``) over ``[system?, user: question + instruction]`` for a
  plain-text prompt, or over the prompt's own messages (with ``system`` prepended when given
  and the messages have no system turn; ``instruction`` is not added to them).
* ``PlainTemplate``: ``str.format`` with ``{question}``, for base models without a chat template.
* ``default_template``: ``ChatTemplate`` when the tokenizer has a chat template, else a
  ``PlainTemplate`` carrying the same system text and instruction.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from grpo_engine.data.errors import DataError
from grpo_engine.types import Prompt

__all__ = ["ChatTemplate", "PlainTemplate", "PromptTemplate", "default_template"]


@runtime_checkable
class PromptTemplate(Protocol):
    """Renders a prompt as the text the tokenizer receives (generation prompt included)."""

    def render(self, prompt: Prompt, tokenizer: Any) -> str:
        """Returns the full prompt text, special tokens included, ending where the model answers."""
        ...


@dataclass(frozen=True)
class ChatTemplate:
    """Renders prompts with the tokenizer's chat template.

    Args:
        system: an optional system message, put first.
        instruction: text appended verbatim to the question of a plain-text prompt (include
            your own separator, for example ``"\\nPut the final answer in \\\\boxed{}."``).

    Example:
        >>> ChatTemplate(system="Be brief.").messages(Prompt("What is 2 + 2?"))
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2 + 2?'}]
    """

    system: str | None = None
    instruction: str = ""

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat messages for ``prompt``, before the tokenizer's template is applied."""
        if isinstance(prompt.content, str):
            messages = [{"role": "user", "content": prompt.content + self.instruction}]
        else:
            messages = [dict(m) for m in prompt.content]
        if self.system is not None and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system})
        return messages

    def render(self, prompt: Prompt, tokenizer: Any) -> str:
        """Applies ``tokenizer.apply_chat_template`` with the generation prompt.

        Raises:
            DataError: the tokenizer has no chat template.
        """
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"{type(tokenizer).__name__} has no chat template (tokenizer.chat_template is "
                "None), so ChatTemplate cannot render; use PlainTemplate() (or "
                "default_template(tokenizer)) for a base model, or set tokenizer.chat_template"
            )
        return tokenizer.apply_chat_template(
            self.messages(prompt), tokenize=False, add_generation_prompt=True
        )


@dataclass(frozen=True)
class PlainTemplate:
    """Renders prompts with ``format.format(question=prompt.question)``.

    Args:
        format: a ``str.format`` template using ``{question}`` and no other field (write
            literal braces as ``{{`` and ``}}``).

    Raises:
        DataError: at construction, when ``format`` does not use exactly ``{question}``.

    Example:
        >>> PlainTemplate().render(Prompt("What is 2 + 2?"), tokenizer=None)
        'Question: What is 2 + 2?\\nAnswer:'
    """

    format: str = "Question: {question}\nAnswer:"

    def __post_init__(self) -> None:
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(self.format) if f is not None}
        except ValueError as err:
            raise DataError(
                f"PlainTemplate format {self.format!r} is not a valid str.format template "
                f"({err}); write literal braces as {{{{ and }}}}"
            ) from err
        if fields != {"question"}:
            raise DataError(
                f"PlainTemplate format {self.format!r} uses the fields {sorted(fields)}; it must "
                "use {question} and no other field, e.g. 'Question: {question}\\nAnswer:'"
            )

    def render(self, prompt: Prompt, tokenizer: Any = None) -> str:
        """Formats the prompt's question; the tokenizer is not used."""
        return self.format.format(question=prompt.question)


def default_template(
    tokenizer: Any, system: str | None = None, instruction: str = ""
) -> ChatTemplate | PlainTemplate:
    """The natural template for ``tokenizer``.

    Args:
        tokenizer: a Hugging Face tokenizer.
        system: an optional system message.
        instruction: text appended verbatim to each question.

    Returns:
        ``ChatTemplate(system, instruction)`` when ``tokenizer.chat_template`` is set; otherwise
        ``PlainTemplate`` with format
        ``"[<system>\\n\\n]Question: {question}<instruction>\\nAnswer:"``.

    Example:
        >>> default_template(None, instruction=" Be brief.")
        PlainTemplate(format='Question: {question} Be brief.\\nAnswer:')
    """
    if getattr(tokenizer, "chat_template", None) is not None:
        return ChatTemplate(system=system, instruction=instruction)
    head = "" if system is None else _escape(system) + "\n\n"
    return PlainTemplate(f"{head}Question: {{question}}{_escape(instruction)}\nAnswer:")


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")
