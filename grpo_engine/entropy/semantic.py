"""Semantic entropy of each group, online, from the G completions a prompt already has.

Kuhn et al. (ICLR 2023, arXiv 2302.09664) and Farquhar et al. (Nature 2024), with answer equivalence in
place of NLI entailment: (1) each completion's final answer is extracted (``extract``, by default
:func:`final_answer`: last ``<answer>`` tag, else last ``\\boxed{}``, else last number); (2) the G answers
are clustered greedily (:func:`cluster_answers`): an answer joins the first cluster whose first member it
equals in both directions (``equal``, by default math-verify's ``answers_equal``; identical strings always
match), and a completion without an answer is a cluster of its own; (3) SE = -Σ_c p_c ln p_c, with
p_c = |c| / G (``mode="discrete"``) or p_c = Σ_{s in c} exp(l_s) / Σ_s exp(l_s) (``mode="likelihood"``,
l_s the mean of ``batch.sampler_logprobs`` over the tokens s's model sampled (``loss_mask``: never a tool's),
by logsumexp: the sum-normalised form, not Kuhn et al.'s Monte Carlo -(1/|C|) Σ_c ln p(c)); (4)
``normalize=True`` divides by ln G, into [0, 1].
``among="wrong"`` / ``"right"``: the same over the completions whose score (``rewards.total``, or
``breakdown[correct_key]``) is below / at or above ``correct_threshold``; clusters come from the whole
group, p_c is renormalised over the m members, ``normalize`` divides by ln m, and m < 2 gives 0.
Pure (no ``.item()``, no logging); math-verify runs on the CPU, O(G · K) comparisons for K clusters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from grpo_engine.ops.answers import answers_equal, final_answer
from grpo_engine.types import Requirements, RewardOutput, RolloutBatch

__all__ = ["SemanticEntropy", "cluster_answers", "semantic_entropy", "sequence_log_likelihood"]

Mode = Literal["discrete", "likelihood"]
Among = Literal["all", "wrong", "right"]


def cluster_answers(
    answers: Sequence[str | None], equal: Callable[[str, str], bool] = answers_equal
) -> list[int]:
    """Cluster ids (0, 1, ... in order of first appearance) of answers grouped by equivalence.

    Greedy, as Kuhn et al.: each answer is compared with one representative (the first member)
    of every cluster so far and joins the first one it equals in both directions; None (no
    answer) always starts a cluster of its own.

    Args:
        answers: extracted final answers, None where a completion has none.
        equal: the equivalence, ``equal(a, b) -> bool``; by default math-verify's.

    Returns:
        One cluster id per answer.

    Example:
        >>> cluster_answers(["1/2", "0.5", None, r"\\frac{1}{2}", "3", None])
        [0, 0, 1, 0, 2, 3]
    """
    reps: list[str | None] = []  # representative of each cluster; None for a no-answer singleton
    ids: list[int] = []
    for answer in answers:
        found = None
        if answer is not None:
            for c, rep in enumerate(reps):
                if rep is not None and (rep == answer or (equal(rep, answer) and equal(answer, rep))):
                    found = c
                    break
        if found is None:
            found = len(reps)
            reps.append(answer)
        ids.append(found)
    return ids


def sequence_log_likelihood(batch: RolloutBatch) -> Tensor:
    """[N] length-normalised log-likelihood of each completion: mean sampler log-prob over the tokens the
    model sampled (``batch.loss_mask``: with tools, the environment's tokens count neither in the sum nor in
    the length).

    A completion with no such token gets 0 (an empty sum, divided by 1). The log-probs are at the
    sampling temperature, as the sampler reports them.

    Raises:
        ValueError: if the batch carries no ``sampler_logprobs``.
    """
    if batch.sampler_logprobs is None:
        raise ValueError(
            "SemanticEntropy(mode='likelihood') needs batch.sampler_logprobs but the sampler reported none; "
            "sample with HFSampler(return_logprobs=True), or use SemanticEntropy(mode='discrete')"
        )
    mask = batch.loss_mask.to(batch.sampler_logprobs.device)
    lp = batch.sampler_logprobs.to(torch.promote_types(batch.sampler_logprobs.dtype, torch.float32))
    total = torch.where(mask, lp, torch.zeros_like(lp)).sum(dim=1)  # where, not *: masked slots may be -inf
    return total / mask.sum(dim=1).clamp(min=1).to(total.dtype)


def semantic_entropy(
    cluster_ids: Tensor,
    *,
    log_likelihood: Tensor | None = None,
    members: Tensor | None = None,
    normalize: bool = False,
) -> Tensor:
    """Entropy of the cluster distribution of each group, from cluster ids (the tensor half of SE).

    Args:
        cluster_ids: [B, G] integer cluster of each completion (ids in [0, G)).
        log_likelihood: [B, G] length-normalised log-likelihoods for the likelihood-weighted form,
            or None for the discrete form (cluster counts).
        members: [B, G] bool, True for the completions that count (default: all); probabilities
            are renormalised over them.
        normalize: divide by ln m, m the number of members of the group (0 where m < 2).

    Returns:
        [B] float entropy in nats (float64 for float64 log-likelihoods, else float32).

    Example:
        >>> semantic_entropy(torch.tensor([[0, 0, 0, 1]]))  # -(3/4 ln 3/4 + 1/4 ln 1/4)
        tensor([0.5623])
    """
    if cluster_ids.dim() != 2:
        raise ValueError(f"cluster_ids shape {tuple(cluster_ids.shape)} must be 2-D [B, G]")
    b, g = cluster_ids.shape
    dtype = (torch.float32 if log_likelihood is None
             else torch.promote_types(log_likelihood.dtype, torch.float32))
    if members is None:
        members = torch.ones(b, g, dtype=torch.bool, device=cluster_ids.device)
    # in_cluster[b, c, s]: completion s is a member and lies in cluster c
    clusters = torch.arange(g, device=cluster_ids.device)
    in_cluster = (cluster_ids.unsqueeze(1) == clusters.view(1, g, 1)) & members.unsqueeze(1)
    m = members.sum(dim=1)  # [B]
    if log_likelihood is None:
        p = in_cluster.sum(dim=2).to(dtype) / m.clamp(min=1).unsqueeze(1).to(dtype)  # [B, K]
    else:
        ll = log_likelihood.to(dtype).unsqueeze(1).expand(b, g, g)
        log_mass = torch.where(in_cluster, ll, torch.full_like(ll, -math.inf)).logsumexp(dim=2)  # [B, K]
        log_total = log_mass.logsumexp(dim=1, keepdim=True)
        p = torch.where(m.unsqueeze(1) > 0, (log_mass - log_total).exp(), torch.zeros_like(log_mass))
    p_log_p = torch.where(p > 0, p * p.clamp(min=torch.finfo(dtype).tiny).log(), torch.zeros_like(p))
    entropy = -p_log_p.sum(dim=1)
    if normalize:
        log_m = m.to(dtype).clamp(min=1).log()
        entropy = torch.where(m >= 2, entropy / log_m.clamp(min=torch.finfo(dtype).tiny),
                              torch.zeros_like(entropy))
    return entropy


@dataclass(frozen=True)
class SemanticEntropy:
    """Per-group semantic entropy from answer clusters (an ``EntropyEstimator``).

    See the module docstring for every rule. Feed it to ``EntropyScaled`` with ``normalize=True``.

    Args:
        mode: ``"discrete"`` (cluster counts) or ``"likelihood"`` (length-normalised sequence
            likelihoods from ``batch.sampler_logprobs``; sample with ``HFSampler(return_logprobs=True)``).
        normalize: divide by ln G (ln of the subset size under ``among``), giving values in [0, 1].
        among: ``"all"`` completions, only the ``"wrong"`` ones (score < ``correct_threshold``) or
            only the ``"right"`` ones (score >= ``correct_threshold``).
        correct_threshold: the score at which a completion counts as right.
        correct_key: a ``rewards.breakdown`` name whose unweighted scores decide correctness, or
            None for ``rewards.total``.
        equal: the answer equivalence, ``equal(a, b) -> bool`` (math-verify's by default).
        extract: completion text -> final answer or None (``final_answer`` by default).

    Example:
        >>> from grpo_engine.types import Prompt
        >>> texts = ("<answer>1/2</answer>", "<answer>0.5</answer>", r"\\boxed{\\frac{1}{2}}",
        ...          "<answer>3</answer>")
        >>> z, ones = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.bool)
        >>> batch = RolloutBatch((Prompt("Half of 1?", "0.5"),), 4, z, ones, z, ones, ~ones[:, 0], texts)
        >>> rewards = RewardOutput(torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
        >>> SemanticEntropy()(batch, rewards)  # clusters of 3 and 1: -(3/4 ln 3/4 + 1/4 ln 1/4)
        tensor([0.5623])
    """

    mode: Mode = "discrete"
    normalize: bool = False
    among: Among = "all"
    correct_threshold: float = 1.0
    correct_key: str | None = None
    equal: Callable[[str, str], bool] = answers_equal
    extract: Callable[[str], str | None] = final_answer

    def __post_init__(self) -> None:
        if self.mode not in get_args(Mode):
            raise ValueError(f"SemanticEntropy: mode={self.mode!r} must be 'discrete' (cluster counts) or "
                             "'likelihood' (sampler log-probs); for example SemanticEntropy(mode='discrete')")
        if self.among not in get_args(Among):
            raise ValueError(f"SemanticEntropy: among={self.among!r} must be 'all', 'wrong' or 'right'; "
                             "for example SemanticEntropy(among='wrong')")
        thr = self.correct_threshold
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or math.isnan(thr):
            raise ValueError(f"SemanticEntropy: correct_threshold={thr!r} must be a number, e.g. 1.0")

    @property
    def requires(self) -> Requirements:
        """The sampler's log-probs in the likelihood mode (``batch.sampler_logprobs``)."""
        return Requirements(sampler_logprobs=self.mode == "likelihood")

    def cluster_ids(self, batch: RolloutBatch) -> Tensor:
        """[B, G] long cluster id of each completion within its group (see :func:`cluster_answers`)."""
        g = batch.group_size
        answers = [self.extract(text) for text in batch.texts]
        ids = [cluster_answers(answers[i:i + g], self.equal) for i in range(0, len(answers), g)]
        return torch.tensor(ids, dtype=torch.long).reshape(batch.num_prompts, g)

    def _members(self, rewards: RewardOutput, shape: tuple[int, int]) -> Tensor | None:
        if self.among == "all":
            return None
        if self.correct_key is None:
            scores = rewards.total
        elif self.correct_key in rewards.breakdown:
            scores = rewards.scored(self.correct_key, f"SemanticEntropy(correct_key={self.correct_key!r})")
        else:
            raise ValueError(f"SemanticEntropy: correct_key={self.correct_key!r} is not a reward in the "
                             f"breakdown {sorted(rewards.breakdown)}; pass one of those names, or None to "
                             "use rewards.total")
        if tuple(scores.shape) != shape:
            raise ValueError(f"SemanticEntropy: correctness scores shape {tuple(scores.shape)} must be "
                             f"[B, G]={shape}")
        right = scores >= self.correct_threshold
        return right if self.among == "right" else ~right

    def __call__(self, batch: RolloutBatch, rewards: RewardOutput) -> Tensor:
        """Semantic entropy of each prompt's group.

        Args:
            batch: the N = B * G completions (``texts``; ``sampler_logprobs`` for the likelihood mode).
            rewards: the step's rewards; used only by ``among="wrong"`` / ``"right"``.

        Returns:
            [B] float32 entropy in nats (in [0, 1] with ``normalize``), on ``rewards.total``'s device.

        Raises:
            ValueError: no ``sampler_logprobs`` in the likelihood mode, an unknown ``correct_key``,
                or rewards not shaped [B, G].
        """
        shape = (batch.num_prompts, batch.group_size)
        if tuple(rewards.total.shape) != shape:
            raise ValueError(f"SemanticEntropy: rewards.total shape {tuple(rewards.total.shape)} must be "
                             f"[B, G]={shape}, the batch's prompts x group_size")
        ll = sequence_log_likelihood(batch).reshape(shape) if self.mode == "likelihood" else None
        ids = self.cluster_ids(batch).to(ll.device if ll is not None else rewards.total.device)
        members = self._members(rewards, shape)
        if members is not None:
            members = members.to(ids.device)
        out = semantic_entropy(ids, log_likelihood=ll, members=members, normalize=self.normalize)
        return out.to(device=rewards.total.device, dtype=torch.float32)
