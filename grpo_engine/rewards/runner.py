"""Running rewards: each reward's [N] scores for a batch, within a time limit, checked, with a policy
for failures.

A reward is called once per batch: ``reward.score_rollout(batch)`` when it defines it (rewards on
tokens, such as ``OverlongPenalty``), else ``reward(batch.row_prompts, batch.texts)`` (with
``episodes=`` a multi-turn batch's, for a reward that sets ``reads_episodes``; ``completion_ids=``, each
row's sampled ids, and ``trainer_state=``, the run's :class:`~grpo_engine.callbacks.TrainerState` or
None, for a reward that sets ``reads_tokens``: what TRL passes its reward functions). The result must
be a floating tensor of shape [N] with finite values (NaN, "does not apply", only from a reward with
``allows_none``). With ``timeout_s`` the call runs in a worker thread and :class:`RewardTimeout` is
raised after it (Python cannot stop the thread; it finishes, or not, in the background). On a
failure ``on_error="raise"`` stops the run; ``"zero"`` scores the failing samples 0 (a batch-level
failure or a timeout: the whole batch; else the samples are scored one by one and only those that
fail get 0) and counts them. :class:`~grpo_engine.rewards.WeightedSum` combines the scores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor

from grpo_engine.rewards.base import RewardError, check_scores
from grpo_engine.types import RolloutBatch

__all__ = ["RewardRunner", "RewardTimeout", "trainer_runner"]


class RewardTimeout(RewardError):
    """A reward did not return within the per-batch timeout."""


@dataclass(frozen=True)
class RewardRunner:
    """Calls rewards on a batch with a time limit and an error policy (the trainer's comes from
    ``GRPOConfig.reward_timeout_s`` and ``on_reward_error``).

    Args:
        timeout_s: seconds per reward per batch, or None for no limit (the call then runs in this thread).
        on_error: ``"raise"`` or ``"zero"`` (see the module docstring).
        state: the run's ``TrainerState``, handed to rewards that read it (``trainer_state=``).

    Example:
        >>> RewardRunner(timeout_s=None).on_error
        'raise'
    """

    timeout_s: float | None = None
    on_error: Literal["raise", "zero"] = "raise"
    state: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "zero"):
            raise ValueError(f"on_error={self.on_error!r} must be 'raise' (stop the run) or 'zero' (score a "
                             "failing sample 0 and count it in reward/<name>/errors)")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0 seconds, or None for no limit")

    def scores(self, reward: Any, batch: RolloutBatch) -> tuple[Tensor, int]:
        """[N] checked float scores of ``reward`` on ``batch``, and how many samples failed (scored 0)."""
        n = batch.num_completions
        score_rollout = getattr(reward, "score_rollout", None)
        extra = self._extra(reward, batch)
        run = (lambda: score_rollout(batch)) if callable(score_rollout) else (
            lambda: reward(batch.row_prompts, batch.texts, **extra(range(n))))
        try:
            return self._checked(reward, self._within(run, reward.name, n), batch.row_prompts, batch.texts), 0
        except RewardError as error:
            if self.on_error == "raise":
                raise
            if isinstance(error, RewardTimeout) or callable(score_rollout):
                return torch.zeros(n), n  # nothing to keep: the whole batch scores 0
        scores, failed = torch.zeros(n), 0  # one failing sample: score the others one by one
        for i in range(n):
            prompt, text = batch.row_prompts[i], batch.texts[i]
            try:
                one = self._within(lambda p=prompt, t=text, i=i: reward([p], [t], **extra([i])),
                                   reward.name, 1)
                scores[i] = self._checked(reward, one, [prompt], [text])[0]
            except RewardError:
                failed += 1
        return scores, failed

    def _extra(self, reward: Any, batch: RolloutBatch) -> Callable[[Any], dict[str, Any]]:
        """The keyword arguments ``reward`` reads, for some of the batch's rows."""
        episodes = batch.episodes if getattr(reward, "reads_episodes", False) else None
        tokens = getattr(reward, "reads_tokens", False)
        ids = [row[mask].tolist() for row, mask in zip(batch.completion_ids.cpu(),
                                                        batch.completion_mask.cpu())] if tokens else []

        def extra(rows: Any) -> dict[str, Any]:
            out: dict[str, Any] = {} if episodes is None else {"episodes": [episodes[i] for i in rows]}
            if tokens:
                out.update(completion_ids=[ids[i] for i in rows], trainer_state=self.state)
            return out
        return extra

    def _within(self, run: Callable[[], Any], name: str, n: int) -> Any:
        """``run()``, in a worker thread when ``timeout_s`` is set; RewardTimeout after it."""
        if self.timeout_s is None:
            return run()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = run()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise RewardTimeout(f"reward {name!r} did not return within {self.timeout_s:g} s on a batch of "
                                f"{n} completions (it keeps running in the background); make it faster, "
                                "raise GRPOConfig.reward_timeout_s, or set on_reward_error='zero' to score "
                                "such batches 0")
        if "error" in box:
            error = box["error"]
            if isinstance(error, RewardError):
                raise error
            raise RewardError(f"reward {name!r} raised {type(error).__name__}: {error}") from error
        return box["value"]

    @staticmethod
    def _checked(reward: Any, scores: object, prompts: Any, texts: Any) -> Tensor:
        """``scores`` when they are a floating [N] tensor of allowed values, else RewardError."""
        name, n = reward.name, len(texts)
        if not isinstance(scores, Tensor):
            raise RewardError(f"reward {name!r} returned {type(scores).__name__}; a RewardFn must return a "
                              f"float tensor of shape [N]=[{n}] (torch.tensor(scores, dtype=torch.float32))")
        if tuple(scores.shape) != (n,):
            raise RewardError(f"reward {name!r} returned shape {tuple(scores.shape)}; expected [N]=[{n}], "
                              "one score per completion (flatten it, and score "
                              "batch.row_prompts/batch.texts)")
        if not scores.is_floating_point():
            raise RewardError(f"reward {name!r} returned dtype {scores.dtype}; expected a floating dtype "
                              "(torch.float32); convert with .float()")
        return check_scores(name, scores.detach().cpu(), prompts, texts,
                            allows_none=getattr(reward, "allows_none", False))


def trainer_runner(own: RewardRunner | None, config: Any, state: Any = None) -> RewardRunner:
    """The runner a trainer scores with: the ``WeightedSum``'s own when the user set one there, else the
    ``GRPOConfig``'s ``reward_timeout_s`` / ``on_reward_error``; never one silently over the other. It
    hands ``state`` (the trainer's ``TrainerState``) to the rewards that read it.

    Raises:
        ValueError: both set them, differently.
    """
    configured = RewardRunner(config.reward_timeout_s, config.on_reward_error)
    if own is None:
        return replace(configured, state=state)
    if own != configured and {"reward_timeout_s", "on_reward_error"} & config.model_fields_set:
        raise ValueError(f"WeightedSum(timeout_s={own.timeout_s!r}, on_error={own.on_error!r}) and "
                         f"GRPOConfig(reward_timeout_s={config.reward_timeout_s!r}, "
                         f"on_reward_error={config.on_reward_error!r}) both set how the rewards run, "
                         "differently; set them in one place (GRPOConfig)")
    return replace(own, state=state)
