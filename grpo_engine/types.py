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

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

__all__ = ["Message", "Prompt", "Draws", "Episode", "EPISODE_ENDS", "RolloutBatch", "RewardOutput", "Rollout",
           "StepRollout", "MicroBatch", "TokenLoss", "LossOutput", "Requirements"]

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
            where = f":{meta['line']}" if "line" in meta else f"[{meta['index']}]"
            return f"{meta['source']}{where}"
        question = self.question
        return f"prompt {question[:40]!r}" + ("..." if len(question) > 40 else "")


@dataclass(frozen=True)
class Draws:
    """How one ``Sampler.sample`` call draws its tokens: from ``seed``, each row's draws keyed by its
    place among the rows of the same call on every rank (the call's prompts are ``first_prompt`` ..
    of ``total_prompts``), so K ranks sampling their shares draw the tokens one process draws.

    Example:
        >>> Draws(seed=7).total(3)
        3
    """

    seed: int
    first_prompt: int = 0
    total_prompts: int | None = None  # None: this call's prompts are all of them

    @classmethod
    def seeded(cls, first_prompt: int = 0, total_prompts: int | None = None) -> Draws:
        """Draws seeded by one number taken from torch's global RNG (``torch.manual_seed`` fixes it)."""
        return cls(int(torch.randint(0, 2**62, ())), first_prompt, total_prompts)

    def total(self, num_prompts: int) -> int:
        """The prompts of the whole call, given this rank's ``num_prompts``."""
        return self.total_prompts if self.total_prompts is not None else num_prompts


EPISODE_ENDS = ("answered", "turn_limit", "token_limit", "reply_too_long", "tool_timeout")
"""The ways a multi-turn rollout ends (:attr:`Episode.end`); docs/tools.md has the table."""


@dataclass(frozen=True)
class Episode:
    """What happened in one multi-turn rollout (a row of a batch sampled with tools).

    Attributes:
        messages: the conversation after the prompt, as chat messages: the model's turns
            (``{"role": "assistant", "content": text}``, the text as sampled, tool calls included) and
            the tools' answers (``{"role": "tool", "name": ..., "content": ...}``).
        tool_calls: every tool call the model made, in order, each ``{"name": ..., "arguments": {...}}``
            (a call that could not be parsed: ``{"name": None, "error": why}``).
        turns: the model's turns.
        environment: the row's environment object (``environment_factory``), or None; it stays in the
            process that sampled the row (not sent to other ranks).
        end: how the rollout ended, one of :data:`EPISODE_ENDS`: ``"answered"`` (a turn without a tool
            call), ``"turn_limit"`` (a call in the last allowed turn: not run), ``"token_limit"`` (the
            budget ran out in a turn, or left no room for the call's reply: not run), ``"reply_too_long"``
            (the calls ran; their replies are cut to the budget, in the messages and the tokens alike)
            or ``"tool_timeout"`` (an environment's call timed out). Every end but ``"answered"`` is a
            truncated row (``RolloutBatch.is_truncated``).

    Raises:
        ValueError: ``end`` is not one of :data:`EPISODE_ENDS`.
    """

    messages: tuple[Mapping[str, Any], ...]
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    turns: int = 1
    environment: Any = None
    end: str = "answered"

    def __post_init__(self) -> None:
        if self.end not in EPISODE_ENDS:
            raise ValueError(f"Episode: end={self.end!r} is not an end state; pass one of {EPISODE_ENDS}")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickles without the environment (an object of the user's, often not picklable)."""
        return Episode, (tuple(dict(m) for m in self.messages), tuple(dict(c) for c in self.tool_calls),
                         self.turns, None, self.end)


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
        completion_mask: [N, C] True on sampled tokens up to and including the first EOS (with
            tools: on every token of the rollout, the model's and the environment's).
        is_truncated: [N] True when the completion hit ``max_completion_tokens`` without EOS (with tools:
            when the rollout ended any other way than with the model's answer, ``Episode.end``).
        texts: the N decoded completions (special tokens removed); with tools, the model's last turn.
        sampler_logprobs: [N, C] log-probabilities of the sampled ids under the sampling
            distribution at the sampling temperature, or None when the sampler does not report them.
        trained_groups: [B] bool, the groups to train on, or None for all of them. A group filter
            (``DynamicSampling``) keeps the dropped groups in the batch, marked False, so callbacks
            and the prompt source hear about every group drawn.
        metrics: counts for the step's log (e.g. ``prompts/truncated``); concatenating batches
            (rounds of sampling, the ranks' shares) adds them up.
        env_mask: [N, C] bool, True on the tokens the environment wrote (tool messages and the chat
            template's turn markers around them), or None (single-turn: none). They are attended to
            and never trained on (:attr:`loss_mask`).
        episodes: the N multi-turn rollouts' conversations (:class:`Episode`), or None (single-turn).
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
    trained_groups: Tensor | None = None  # [B] bool
    metrics: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    env_mask: Tensor | None = None  # [N, C] bool
    episodes: tuple[Episode, ...] | None = None

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
        if self.episodes is not None:
            shapes["episodes"] = len(self.episodes)
        bad = {k: v for k, v in shapes.items() if v != n}
        if self.env_mask is not None and self.env_mask.shape != self.completion_mask.shape:
            bad["env_mask"] = tuple(self.env_mask.shape)
        if bad:
            raise ValueError(f"RolloutBatch rows must all equal B*G={n}; got {bad}")
        b = len(self.prompts)
        if self.trained_groups is not None and tuple(self.trained_groups.shape) != (b,):
            raise ValueError(f"RolloutBatch.trained_groups shape {tuple(self.trained_groups.shape)} must be "
                             f"[B]=[{b}]; pass one bool per prompt group")

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
        """[N] number of tokens the model sampled in each completion: with tools, the environment's tokens
        (``env_mask``) are not counted (:attr:`loss_mask`), as TRL counts them."""
        return self.loss_mask.sum(dim=1)

    @property
    def loss_mask(self) -> Tensor:
        """[N, C] True on the tokens the loss trains on: the sampled ones (``completion_mask`` without
        ``env_mask``)."""
        if self.env_mask is None:
            return self.completion_mask
        return self.completion_mask & ~self.env_mask.to(self.completion_mask.device)

    @property
    def input_ids(self) -> Tensor:
        """[N, T] prompt and completion ids side by side."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """[N, T] True on real prompt tokens and on kept completion tokens."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def select_groups(self, groups: Tensor) -> RolloutBatch:
        """The batch of the groups ``groups`` (indices into B), in that order."""
        g = self.group_size
        rows = (groups[:, None] * g + torch.arange(g)[None, :]).flatten()
        logprobs, marks = self.sampler_logprobs, self.trained_groups
        env, episodes = self.env_mask, self.episodes
        return dataclasses.replace(
            self, prompts=tuple(self.prompts[i] for i in groups.tolist()),
            prompt_ids=self.prompt_ids[rows], prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows], completion_mask=self.completion_mask[rows],
            is_truncated=self.is_truncated[rows], texts=tuple(self.texts[i] for i in rows.tolist()),
            sampler_logprobs=logprobs[rows] if logprobs is not None else None,
            trained_groups=marks[groups] if marks is not None else None,
            env_mask=env[rows] if env is not None else None,
            episodes=tuple(episodes[i] for i in rows.tolist()) if episodes is not None else None)

    @staticmethod
    def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """One batch from several of one group size: prompts re-left-padded, completions re-right-padded,
        ``metrics`` added up, groups without marks marked trained where another batch has marks."""
        if len({b.group_size for b in batches}) != 1:
            raise ValueError(f"cannot concatenate batches of group sizes {[b.group_size for b in batches]}")
        if len(batches) == 1:
            return batches[0]
        p_width = max(b.prompt_ids.shape[1] for b in batches)
        c_width = max(b.completion_ids.shape[1] for b in batches)
        pad_id = 0  # padded positions are masked out everywhere; any valid id will do
        logprobs = [b.sampler_logprobs for b in batches]
        marks = None if all(b.trained_groups is None for b in batches) else torch.cat(
            [b.trained_groups if b.trained_groups is not None else torch.ones(b.num_prompts, dtype=torch.bool)
             for b in batches])
        return RolloutBatch(
            prompts=tuple(p for b in batches for p in b.prompts), group_size=batches[0].group_size,
            prompt_ids=_pad([b.prompt_ids for b in batches], p_width, pad_id, left=True),
            prompt_mask=_pad([b.prompt_mask for b in batches], p_width, False, left=True),
            completion_ids=_pad([b.completion_ids for b in batches], c_width, pad_id, left=False),
            completion_mask=_pad([b.completion_mask for b in batches], c_width, False, left=False),
            is_truncated=torch.cat([b.is_truncated for b in batches]),
            texts=tuple(t for b in batches for t in b.texts),
            sampler_logprobs=None if any(lp is None for lp in logprobs) else _pad(logprobs, c_width, 0.0,
                                                                                   left=False),
            trained_groups=marks, metrics=MappingProxyType(_summed([b.metrics for b in batches])),
            env_mask=None if all(b.env_mask is None for b in batches) else _pad(
                [torch.zeros_like(b.completion_mask) if b.env_mask is None else b.env_mask for b in batches],
                c_width, False, left=False),
            episodes=None if any(b.episodes is None for b in batches) else tuple(
                e for b in batches for e in b.episodes),
        )

    def to_cpu(self) -> RolloutBatch:
        """The batch on the CPU, picklable (a plain dict of metrics), to send to other processes."""
        tensors = {f.name: getattr(self, f.name).cpu() for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **tensors, metrics=dict(self.metrics))


@dataclass(frozen=True)
class RewardOutput:
    """Rewards of a step.

    Attributes:
        total: [B, G] the weighted combination that advantages are computed from.
        breakdown: reward name -> [B, G] unweighted scores of each component, for logging.
        errors: reward name -> samples whose scoring failed and were scored 0 (``on_reward_error="zero"``).
        metrics: counts the rewards reported for the step's log (``reward/<name>/<key>``, e.g.
            ``CodeTests``' ``reward/code_tests/timeout``); added up over batches.
    """

    total: Tensor  # [B, G]
    breakdown: Mapping[str, Tensor] = field(default_factory=dict)  # name -> [B, G]
    errors: Mapping[str, int] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)

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
            raise KeyError(f"{used_by}: not one of the rewards {sorted(self.breakdown)}; pass one of those "
                           "names")
        values = self.breakdown[name]
        missing = int(values.isnan().sum())
        if missing:
            raise ValueError(f"{used_by}: the reward {name!r} returned None for {missing} of "
                             f"{values.numel()} samples (it does not apply there), so a group's accuracy or "
                             "spread is undefined; name a reward that scores every sample")
        return values

    def select_groups(self, groups: Tensor) -> RewardOutput:
        """The rewards of the groups ``groups`` (indices into B); error counts are the step's."""
        at = groups.to(self.total.device)
        return RewardOutput(total=self.total[at], breakdown={k: v[at] for k, v in self.breakdown.items()},
                            errors=self.errors, metrics=self.metrics)

    @staticmethod
    def concat(parts: Sequence[RewardOutput]) -> RewardOutput:
        """The rewards of consecutive batches as one: [B_i, G] stacked, error counts added up."""
        breakdown = {k: torch.cat([p.breakdown[k] for p in parts]) for k in parts[0].breakdown}
        return RewardOutput(total=torch.cat([p.total for p in parts]), breakdown=breakdown,
                            errors=_summed([p.errors for p in parts]),
                            metrics=_summed([p.metrics for p in parts]))

    def to_cpu(self) -> RewardOutput:
        """The rewards on the CPU, picklable (plain dicts), to send to other processes."""
        return RewardOutput(total=self.total.cpu(), breakdown={k: v.cpu() for k, v in self.breakdown.items()},
                            errors=dict(self.errors), metrics=dict(self.metrics))


@dataclass(frozen=True)
class Rollout:
    """Sampled completions with their rewards and per-group uncertainty: stages 1 and 2 of a step.

    Attributes:
        batch: the completions (every group drawn; ``batch.trained_groups`` marks those to train on).
        rewards: their rewards, total and breakdown [B, G].
        uncertainty: [B] from the entropy estimator, or None without one.
    """

    batch: RolloutBatch
    rewards: RewardOutput
    uncertainty: Tensor | None = None  # [B]

    def select_groups(self, groups: Tensor) -> Rollout:
        """The groups ``groups`` (indices into B) of the batch, the rewards and the uncertainty."""
        uncertainty = self.uncertainty
        return Rollout(self.batch.select_groups(groups), self.rewards.select_groups(groups),
                       uncertainty[groups.to(uncertainty.device)] if uncertainty is not None else None)

    def trained(self) -> Rollout:
        """The groups marked for training (all of them when none are marked)."""
        marks = self.batch.trained_groups
        if marks is None or bool(marks.all()):
            return self
        return self.select_groups(marks.nonzero().flatten())

    @staticmethod
    def concat(parts: Sequence[Rollout]) -> Rollout:
        """Consecutive rollouts as one (rounds of sampling, or the ranks' shares in rank order)."""
        uncertain = [p.uncertainty for p in parts]
        return Rollout(RolloutBatch.concat([p.batch for p in parts]),
                       RewardOutput.concat([p.rewards for p in parts]),
                       None if any(u is None for u in uncertain) else torch.cat(uncertain))

    def to_cpu(self) -> Rollout:
        """The rollout on the CPU, picklable."""
        return Rollout(self.batch.to_cpu(), self.rewards.to_cpu(),
                       self.uncertainty.cpu() if self.uncertainty is not None else None)


@dataclass(frozen=True)
class StepRollout:
    """A step's rollout as this process holds it and as a whole.

    ``local`` is this rank's share (the rows it trains); ``whole`` is every rank's, in rank order:
    what advantages, the loss's counts, metrics, callbacks and the prompt source see. One process
    holds the same rollout twice.

    Attributes:
        local: this rank's rollout.
        whole: every rank's rollouts, concatenated in rank order.
        groups_per_rank: B of each rank's local rollout (sums to ``whole``'s B).
        rank: this process's rank.
    """

    local: Rollout
    whole: Rollout
    groups_per_rank: tuple[int, ...]
    rank: int = 0

    def trained(self) -> StepRollout:
        """The groups marked for training, in both views (every group when none are marked)."""
        marks = self.whole.batch.trained_groups
        if marks is None:
            return self
        bounds = torch.tensor([0, *self.groups_per_rank]).cumsum(0).tolist()
        kept = tuple(int(marks[start:end].sum()) for start, end in zip(bounds[:-1], bounds[1:]))
        return StepRollout(self.local.trained(), self.whole.trained(), kept, self.rank)

    def local_rows(self, values: Tensor) -> Tensor:
        """This rank's rows of ``values`` [N, ...] (the whole step's rows, in rank order)."""
        g = self.whole.batch.group_size
        start = sum(self.groups_per_rank[:self.rank]) * g
        return values[start:start + self.groups_per_rank[self.rank] * g]

    def with_rewards(self, local: RewardOutput, whole: RewardOutput) -> StepRollout:
        """The same rollout with new rewards (a reward transform's), this rank's and the whole step's."""
        return dataclasses.replace(self, local=dataclasses.replace(self.local, rewards=local),
                                   whole=dataclasses.replace(self.whole, rewards=whole))


@dataclass(frozen=True)
class MicroBatch:
    """What a loss sees for n completions of one forward/backward pass.

    Attributes:
        completion_mask: [n, C] True on tokens that count in the loss.
        advantages: [n] one advantage per completion (broadcast over its tokens).
        old_logprobs: [n, C] log-probs under the policy that sampled, or None when the loss
            should treat the current (detached) log-probs as old (one update per batch, on-policy).
        ref_logprobs: [n, C] log-probs under the reference policy, when the loss asks for them
            (``Requirements.ref_logprobs``), else None.
        is_truncated: [n] True where the completion has no EOS.
        entropy: [n, C] token entropy of the current policy at the sampling temperature, with
            gradient, when the loss asks for it (``Requirements.entropy``), else None.
        sampler_logprobs: [n, C] the sampler's own log-probs of the tokens, when the loss asks
            for them (``Requirements.sampler_logprobs``), else None.
        entropy_pool: [k] when the loss asks for it (``Requirements.entropy_pool``): the values the
            loss's ``pooled_entropy`` gave for this micro-batch on every rank (the i-th micro-batch of
            each, in rank order), for a statistic such as the top-entropy threshold. None: this
            micro-batch alone (the same on one process).
    """

    completion_mask: Tensor  # [n, C] bool
    advantages: Tensor  # [n]
    old_logprobs: Tensor | None = None  # [n, C]
    ref_logprobs: Tensor | None = None  # [n, C]
    is_truncated: Tensor | None = None  # [n] bool
    entropy: Tensor | None = None  # [n, C]
    sampler_logprobs: Tensor | None = None  # [n, C]
    entropy_pool: Tensor | None = None  # [k]


@dataclass(frozen=True)
class TokenLoss:
    """The per-token parts of a clipped surrogate that a ``LossTerm`` changes.

    Attributes:
        mask: [n, C] bool, the tokens that count.
        logprobs: [n, C] the current log-probs (with gradient; 0 on padding).
        old_logprobs: [n, C] the detached old log-probs (0 on padding).
        policy: [n, C] the policy term of each token (rescaled or masked by surrogate weights).
        clipped: [n, C] bool, tokens whose surrogate gradient a clip cuts.
        penalty: [n, C] what is added to each token's loss (a KL, an entropy bonus), 0 to start.
        num_valid_tokens: the step-global count of tokens (for metrics that are step shares).
        metrics: detached step-share metrics the terms report.
    """

    mask: Tensor
    logprobs: Tensor
    old_logprobs: Tensor
    policy: Tensor
    clipped: Tensor
    penalty: Tensor
    num_valid_tokens: int
    metrics: Mapping[str, Tensor] = field(default_factory=dict)

    def replace(self, **changes: Any) -> TokenLoss:
        """A copy with ``changes``; ``metrics=`` adds to the metrics already there."""
        if "metrics" in changes:
            changes["metrics"] = {**self.metrics, **changes["metrics"]}
        return dataclasses.replace(self, **changes)


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
        entropy_pool: ``MicroBatch.entropy_pool``, the entropies the loss pools over the i-th
            micro-batch of every rank (the loss implements ``pooled_entropy``).

    Example:
        >>> Requirements(ref_logprobs=True).entropy
        False
        >>> Requirements.union([Requirements(entropy=True), Requirements(ref_logprobs=True)]).ref_logprobs
        True
    """

    ref_logprobs: bool = False
    old_logprobs: bool = False
    sampler_logprobs: bool = False
    entropy: bool = False
    zero_advantage_rows: bool = True
    entropy_pool: bool = False

    @staticmethod
    def union(parts: Sequence[Requirements]) -> Requirements:
        """What any of ``parts`` needs (every flag False for none)."""
        return Requirements(**{f.name: any(getattr(p, f.name) for p in parts)
                               for f in dataclasses.fields(Requirements)})

    def missing(self, batch: MicroBatch, shape: tuple[int, ...]) -> list[str]:
        """What ``batch`` lacks of the inputs asked for, one phrase each ("needs batch.entropy [n, C],
        which is None"), or holds in another shape than the log-probs' ``shape`` [n, C]."""
        problems = []
        for name in ("ref_logprobs", "sampler_logprobs", "entropy"):
            value = getattr(batch, name)
            if getattr(self, name) and value is None:
                problems.append(f"needs batch.{name} [n, C], which is None")
            elif getattr(self, name) and tuple(value.shape) != shape:
                problems.append(f"needs one value per token: batch.{name} shape {tuple(value.shape)} must "
                                f"equal logprobs shape {shape}")
        return problems


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


def _pad(tensors: Sequence[Tensor], width: int, value: float | int | bool, left: bool) -> Tensor:
    out = []
    for t in tensors:
        pad = t.new_full((t.shape[0], width - t.shape[1]), value)
        out.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(out)


def _summed(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out
