"""The environment's messages as token ids: the chat template's frame by construction, the content as text.

What a tool returns (and what a program the model wrote prints through the python tool) is data. It
never becomes a special token: a tool that prints ``<|im_end|>``, ``<|eot_id|>``, ``</s>`` or a
tool-call tag gives the model those characters as ordinary text tokens, and the turn structure stays
the template's.

- The frame (the text the template writes around each tool message: the end of the assistant turn, the
  role header, the end of the message, the next generation prompt) is found by construction: the
  conversation is rendered with a fixed slot string in place of each tool message's content, and the
  text between our own assistant placeholder and the slots is the frame. The tools' text is never
  searched. The frame is tokenised with its special tokens, as the template's own text.
- A message's content is what the template writes for it (a template may transform it, e.g. Llama 3.1
  writes ``content | tojson``): the conversation is rendered again with that one content in its slot,
  and the text between the known frame before and after it is taken by length. A template whose frame
  changes with the content falls back to the content itself. That text is tokenised as text
  (:func:`text_ids`): no added token, special or not, comes from it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["environment_ids", "text_ids", "TURN"]

TURN = "\ue000grpo-engine-turn\ue000"  # stands for an assistant turn's text when the template is rendered


def _slot(k: int) -> str:
    """The k-th tool message's content when the frame is rendered: ASCII letters and digits, so a template
    that escapes or quotes its content (``tojson``) writes it unchanged."""
    return f"GrpoEngineToolSlot{k}Qx"


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` as text: the tokenizer's normaliser, pre-tokenizer and model, without its added
    tokens, so a special-token string in ``text`` (``<|im_end|>``, ``</s>``) or a non-special added
    token's (Qwen's ``<tool_call>``) becomes ordinary tokens; ``decode`` gives ``text`` back.

    Example:
        >>> # text_ids(qwen_tokenizer, "<|im_end|>") -> the ids of "<", "|", "im", "_end", "|", ">"
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the fast tokenizer's own pipeline, added tokens left out
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = [text] if backend.pre_tokenizer is None else [
            p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for piece in pieces for token in backend.model.tokenize(piece)]
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if added.isdisjoint(ids):
        return ids
    # a non-special added token was matched: one character at a time, no multi-character token can form
    return [i for ch in text for i in tokenizer(ch, add_special_tokens=False, split_special_tokens=True)
            ["input_ids"]]


def environment_ids(render: Callable[[list[dict[str, Any]]], str], tokenizer: Any,
                    messages: Sequence[dict[str, Any]], replies: Sequence[dict[str, Any]], *,
                    sampled_eos: int | None = None) -> list[int]:
    """The ids the chat template writes for ``replies`` (tool messages) after an assistant turn of the
    conversation ``messages``, through the next generation prompt: each frame's ids as the template's,
    each content's as text. ``sampled_eos``: the EOS id the model's turn ended with, left out of the
    frame when it is the frame's first id (the model already wrote it).

    ``render(messages) -> str`` renders a conversation with the generation prompt.

    Raises:
        ValueError: the template does not write each tool message's content exactly once after the
            assistant turn (a property of the template, never of the content).
    """
    def conversation(contents: Sequence[str]) -> str:
        return render([*messages, {"role": "assistant", "content": TURN},
                       *({**r, "content": c} for r, c in zip(replies, contents))])

    slots = [_slot(k) for k in range(len(replies))]
    base = conversation(slots)
    start = base.rindex(TURN) + len(TURN)  # after it: the template's text and our slots, nothing else
    frames, places, at = [], [], start
    for slot in slots:
        found = base.find(slot, at)
        if found < 0 or base.count(slot, start) != 1:
            raise ValueError("the chat template does not write each tool message's content exactly once "
                             "after the assistant turn; ToolSampler needs one that does (as ChatML does)")
        frames.append(base[at:found])
        places.append(found)
        at = found + len(slot)
    frames.append(base[at:])
    ids = tokenizer(frames[0], add_special_tokens=False)["input_ids"]
    if sampled_eos is not None and ids[:1] == [sampled_eos]:
        ids = ids[1:]
    for k, (reply, place) in enumerate(zip(replies, places)):
        ids += text_ids(tokenizer, _written(conversation, slots, k, str(reply["content"]), base, place))
        ids += tokenizer(frames[k + 1], add_special_tokens=False)["input_ids"]
    return ids


def _written(conversation: Callable[[Sequence[str]], str], slots: list[str], k: int, content: str, base: str,
             place: int) -> str:
    """What the template writes for the k-th content: the conversation rendered with it in its slot, less
    the known text before and after the slot (taken by length, never by searching the content)."""
    head, tail = base[:place], base[place + len(slots[k]):]
    text = conversation([*slots[:k], content, *slots[k + 1:]])
    if len(text) >= len(head) + len(tail) and text.startswith(head) and text.endswith(tail):
        return text[len(head):len(text) - len(tail)]
    warnings.warn("the chat template writes a tool message's frame differently for different contents; the "
                  "content is tokenised as it is, within the frame rendered for a placeholder", stacklevel=3)
    return content
