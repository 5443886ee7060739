"""Held-out evaluation: greedy pass@1 of a policy on a prompt set, scored by a reward.

A completion counts as correct when the reward gives it at least ``threshold`` (1.0 for
``MathAccuracy``). Prompts are rendered with the same template the sampler uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from grpo_engine.data.templates import PromptTemplate
from grpo_engine.protocols import RewardFn
from grpo_engine.sampling.hf import HFSampler, completion_mask_from_ids
from grpo_engine.types import Prompt

__all__ = ["EvalResult", "greedy_accuracy"]


@dataclass(frozen=True)
class EvalResult:
    """Greedy accuracy and what each prompt got.

    Attributes:
        accuracy: fraction of prompts whose greedy completion scored >= threshold.
        completions: the greedy completion of each prompt.
        scores: the reward of each completion.
    """

    accuracy: float
    completions: tuple[str, ...]
    scores: tuple[float, ...]


@torch.no_grad()
def greedy_accuracy(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Prompt],
    reward: RewardFn,
    *,
    template: PromptTemplate | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    threshold: float = 1.0,
) -> EvalResult:
    """Greedy-decodes each prompt once and scores it.

    Args:
        model: the policy (LoRA-wrapped models work).
        tokenizer: its tokenizer.
        prompts: the held-out prompts, with targets.
        reward: scores a completion (e.g. ``MathAccuracy()``).
        template: the prompt template (default: the chat template when the tokenizer has one).
        max_new_tokens: generation limit.
        batch_size: prompts per generate call.
        threshold: score at or above which a completion is correct.

    Returns:
        An ``EvalResult``.
    """
    if not prompts:
        raise ValueError("greedy_accuracy got no prompts; pass the held-out prompt list")
    encoder = HFSampler(model, tokenizer, template=template, max_prompt_tokens=10**9)
    was_training = model.training
    model.eval()
    texts: list[str] = []
    device = next(model.parameters()).device
    try:
        for start in range(0, len(prompts), batch_size):
            ids, mask = encoder.encode_prompts(prompts[start:start + batch_size])
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.long().to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=encoder.eos_ids,
                                 pad_token_id=encoder.pad_id, temperature=None, top_p=None, top_k=None)
            completion = out[:, ids.shape[1]:]
            keep, _ = completion_mask_from_ids(completion, encoder.eos_ids)
            texts += tokenizer.batch_decode([row[m].tolist() for row, m in zip(completion, keep)],
                                            skip_special_tokens=True)
    finally:
        model.train(was_training)
    scores = reward(list(prompts), texts).tolist()
    correct = sum(s >= threshold for s in scores)
    return EvalResult(accuracy=correct / len(prompts), completions=tuple(texts), scores=tuple(scores))
