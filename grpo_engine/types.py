"""Frozen records that cross every boundary of a GRPO step.

Shape legend, used in every tensor comment of the package:

    B  prompts in the step (``prompts_per_step``)
    G  completions per prompt (``group_size``)
    N  completions in the step, N = B * G; row ``b * G + g`` is completion ``g`` of prompt ``b``
    n  completions in one micro-batch
    P  prompt tokens (left-padded to the longest prompt of the batch)
    C  completion tokens (right-padded to the longest completion of the batch)
    T  P + C
    V  vocabulary size

Masks are boolean and True means "keep". The ground truth (``Prompt.target``) travels with its
prompt, so no stage ever joins prompts and answers by index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

__all__ = ["Message", "Prompt", "RolloutBatch", "RewardOutput", "MicroBatch", "LossOutput", "Requirements"]

Message = Mapping[str, str]  # {"role": "user", "content": "..."}


@dataclass(frozen=True)
class Prompt:
    """One training or evaluation question with its reference answer.

    Args:
        content: the question as plain text, or a conversation as a tuple of chat messages
            (``{"role": ..., "content": ...}``). A template turns it into tokens.
        target: the reference answer (for example ``"42"`` or ``"\\frac{1}{2}"``), or None for
            rewards that need none.
        metadata: free information (source file and line, task id, difficulty...).

    Example:
        >>> p = Prompt("What is 7 + 5?", target="12")
        >>> p.question
        'What is 7 + 5?'
    """

    content: str | tuple[Message, ...]
    target: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if isinstance(self.content, list):
            object.__setattr__(self, "content", tuple(self.content))
        if not isinstance(self.metadata, MappingProxyType):
            object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickles (a read-only metadata view does not): for worker processes and torchrun ranks."""
        return Prompt, (self.content, self.target, dict(self.metadata))

    @property
    def question(self) -> str:
        """The text of the last user turn (the whole content for a plain-text prompt)."""
        if isinstance(self.content, str):
            return self.content
        users = [m["content"] for m in self.content if m.get("role") == "user"]
        return users[-1] if users else self.content[-1]["content"]

    @property
    def location(self) -> str:
        """Where the prompt came from, for messages: ``file:line`` or ``file[index]`` when a loader
        recorded it, else the start of the question."""
        meta = self.metadata
        if "source" in meta and ("line" in meta or "index" in meta):
            return f"{meta['source']}:{meta['line']}" if "line" in meta else f"{meta['source']}[{meta['index']}]"
        question = self.question
        return f"prompt {question[:40]!r}" + ("..." if len(question) > 40 else "")


@dataclass(frozen=True)
class RolloutBatch:
    """The completions sampled for one step: G per prompt, N = B * G rows.

    Token ids are exactly the ids the sampler drew (never decoded and re-tokenised).

    Attributes:
        prompts: the B prompts; row ``i`` belongs to ``prompts[i // group_size]``.
        group_size: G.
        prompt_ids: [N, P] left-padded prompt ids.
        prompt_mask: [N, P] True on real prompt tokens.
        completion_ids: [N, C] right-padded sampled ids, the EOS token included when sampled.
        completion_mask: [N, C] True on sampled tokens up to and including the first EOS.
        is_truncated: [N] True when the completion hit ``max_completion_tokens`` without EOS.
        texts: the N decoded completions (special tokens removed).
        sampler_logprobs: [N, C] log-probabilities of the sampled ids under the sampling
            distribution at the sampling temperature, or None when the sampler does not report them.
        rewards: the batch's rewards when the sampler had to score it (DAPO's dynamic sampling
            filters on them); the trainer then does not score it again. None otherwise.
        trained_groups: [B] bool, the groups to train on, or None for all of them. A sampler that
            filters groups keeps the dropped ones in the batch, marked False, so callbacks and the
            prompt source hear about every group drawn.
        metrics: numbers the sampler reports for the step's log (e.g. ``dynamic_sampling/rounds``).
    """

    prompts: tuple[Prompt, ...]
    group_size: int
    prompt_ids: Tensor  # [N, P]
    prompt_mask: Tensor  # [N, P] bool
    completion_ids: Tensor  # [N, C]
    completion_mask: Tensor  # [N, C] bool
    is_truncated: Tensor  # [N] bool
    texts: tuple[str, ...]
    sampler_logprobs: Tensor | None = None  # [N, C]
    rewards: RewardOutput | None = None  # total / breakdown [B, G]
    trained_groups: Tensor | None = None  # [B] bool
    metrics: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        n = len(self.prompts) * self.group_size
        shapes = {
            "prompt_ids": self.prompt_ids.shape[0],
            "prompt_mask": self.prompt_mask.shape[0],
            "completion_ids": self.completion_ids.shape[0],
            "completion_mask": self.completion_mask.shape[0],
            "is_truncated": self.is_truncated.shape[0],
            "texts": len(self.texts),
        }
        bad = {k: v for k, v in shapes.items() if v != n}
        if bad:
            raise ValueError(f"RolloutBatch rows must all equal B*G={n}; got {bad}")
        b = len(self.prompts)
        if self.trained_groups is not None and tuple(self.trained_groups.shape) != (b,):
            raise ValueError(f"RolloutBatch.trained_groups shape {tuple(self.trained_groups.shape)} must be [B]=[{b}]; "
                             "pass one bool per prompt group")
        if self.rewards is not None and tuple(self.rewards.total.shape) != (b, self.group_size):
            raise ValueError(f"RolloutBatch.rewards.total shape {tuple(self.rewards.total.shape)} must be "
                             f"[B, G]=[{b}, {self.group_size}]")

    @property
    def num_prompts(self) -> int:
        """B."""
        return len(self.prompts)

    @property
    def num_completions(self) -> int:
        """N = B * G."""
        return len(self.texts)

    @property
    def row_prompts(self) -> tuple[Prompt, ...]:
        """The prompt of each of the N completions (each prompt repeated G times)."""
        return tuple(p for p in self.prompts for _ in range(self.group_size))

    @property
    def completion_lengths(self) -> Tensor:
        """[N] number of sampled tokens of each completion."""
        return self.completion_mask.sum(dim=1)

    @property
    def input_ids(self) -> Tensor:
        """[N, T] prompt and completion ids side by side."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    def trimmed(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(prompt_ids, prompt_mask, completion_ids, completion_mask)`` of ``rows`` without the
        columns that are padding in every one of those rows (left for prompts, right for completions)."""
        prompt_mask = self.prompt_mask[rows]
        completion_mask = self.completion_mask[rows]
        first = int(prompt_mask.any(dim=0).long().argmax())  # first prompt column any row uses
        width = max(1, int(completion_mask.sum(dim=1).max()))
        return (self.prompt_ids[rows, first:], prompt_mask[:, first:], self.completion_ids[rows, :width],
                completion_mask[:, :width])

    @property
    def attention_mask(self) -> Tensor:
        """[N, T] True on real prompt tokens and on kept completion tokens."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


@dataclass(frozen=True)
class RewardOutput:
    """Rewards of a step.

    Attributes:
        total: [B, G] the weighted combination that advantages are computed from.
        breakdown: reward name -> [B, G] unweighted scores of each component, for logging.
        errors: reward name -> samples whose scoring failed and were scored 0 (``on_reward_error="zero"``).
    """

    total: Tensor  # [B, G]
    breakdown: Mapping[str, Tensor] = field(default_factory=dict)  # name -> [B, G]
    errors: Mapping[str, int] = field(default_factory=dict)

    def scored(self, name: str, used_by: str) -> Tensor:
        """[B, G] the breakdown reward ``name``, for a statistic of every sample (a group's accuracy or
        spread); ``used_by`` names the setting that asks, for the errors.

        Raises:
            KeyError: no reward of that name.
            ValueError: the reward returned None for some samples (NaN here: it does not apply there).

        Example:
            >>> RewardOutput(torch.zeros(1, 2), {"acc": torch.tensor([[1.0, 0.0]])}).scored("acc", "key")
            tensor([[1., 0.]])
        """
        if name not in self.breakdown:
            raise KeyError(f"{used_by}: not one of the rewards {sorted(self.breakdown)}; pass one of those names")
        values = self.breakdown[name]
        missing = int(values.isnan().sum())
        if missing:
            raise ValueError(f"{used_by}: the reward {name!r} returned None for {missing} of {values.numel()} "
                             "samples (it does not apply there), so a group's accuracy or spread is undefined; "
                             "name a reward that scores every sample")
        return values


@dataclass(frozen=True)
class MicroBatch:
    """What a loss sees for n completions of one forward/backward pass.

    Attributes:
        completion_mask: [n, C] True on tokens that count in the loss.
        advantages: [n] one advantage per completion (broadcast over its tokens).
        old_logprobs: [n, C] log-probs under the policy that sampled, or None when the loss
            should treat the current (detached) log-probs as old (one update per batch, on-policy).
        ref_logprobs: [n, C] log-probs under the reference policy, or None when no KL is used.
        is_truncated: [n] True where the completion has no EOS.
        entropy: [n, C] token entropy of the current policy at the sampling temperature, with
            gradient, when the loss asks for it (``requires_entropy``), else None.
        sampler_logprobs: [n, C] the sampler's own log-probs of the tokens, when the loss asks
            for them (``requires_sampler_logprobs``), else None.
        gather: when the loss asks for it (``requires.micro_batch_gather``), a function that returns
            a 1-D tensor concatenated over this micro-batch of every rank (the i-th of each, in
            rank order; itself on one process), for a statistic over the micro-batch such as the
            top-entropy threshold. Called once per micro-batch, on every rank. None: the micro-batch
            alone.
    """

    completion_mask: Tensor  # [n, C] bool
    advantages: Tensor  # [n]
    old_logprobs: Tensor | None = None  # [n, C]
    ref_logprobs: Tensor | None = None  # [n, C]
    is_truncated: Tensor | None = None  # [n] bool
    entropy: Tensor | None = None  # [n, C]
    sampler_logprobs: Tensor | None = None  # [n, C]
    gather: Callable[[Tensor], Tensor] | None = None  # [k] -> [k over every rank]


@dataclass(frozen=True)
class Requirements:
    """What a component needs the trainer to compute for it, read once when the trainer is built.

    Attributes:
        ref_logprobs: reference-policy log-probs (``MicroBatch.ref_logprobs``, or a reward
            transform's ``ref_logprobs``); the trainer then keeps a reference policy.
        old_logprobs: the sampling policy's log-probs from a separate no-grad pass, even when
            ``updates_per_batch == 1``.
        sampler_logprobs: the sampler's own log-probs of the sampled tokens.
        entropy: the token entropy with gradient (``MicroBatch.entropy``).
        zero_advantage_rows: a completion with advantage 0 can change the loss; False lets the
            trainer skip its forward and backward (a loss whose every term is scaled by A).
        micro_batch_gather: the loss calls ``MicroBatch.gather`` once per micro-batch (a statistic
            over the i-th micro-batch of every rank); the trainer then supplies it, and a rank with
            fewer micro-batches than another joins the missing calls with nothing.

    Example:
        >>> Requirements(ref_logprobs=True).entropy
        False
    """

    ref_logprobs: bool = False
    old_logprobs: bool = False
    sampler_logprobs: bool = False
    entropy: bool = False
    zero_advantage_rows: bool = True
    micro_batch_gather: bool = False


@dataclass(frozen=True)
class LossOutput:
    """A loss value and its metrics.

    Attributes:
        loss: scalar to call ``backward()`` on. It is already divided by the step-global count,
            so summing the losses of all micro-batches gives the loss of the whole step.
        metrics: detached scalars normalised the same way: summing a metric over the
            micro-batches of a step gives its step value (for example the clip fraction).
    """

    loss: Tensor
    metrics: Mapping[str, Tensor] = field(default_factory=dict)
