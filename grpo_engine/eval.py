"""Held-out evaluation: pass@1 (greedy and sampled), pass@k and maj@k of a policy on a prompt set.

For n prompts (docs/evaluation.md): ``pass@1`` is the fraction whose greedy completion is correct;
``avg@k`` (sampled pass@1) is the mean over prompts of c/k, with c of k samples at ``temperature``
correct; ``pass@k`` is the mean of Chen et al.'s unbiased 1 - C(s-c, k) / C(s, k) for c correct of s
samples (arXiv 2107.03374), computed as a product (:func:`pass_at_k`); with s = k samples drawn, it is
the fraction of prompts with at least one correct sample; ``maj@k`` is the fraction whose majority
answer is correct: final answers are extracted as ``MathAccuracy`` does, clustered with math-verify's
``answers_equal`` (:func:`majority_vote`), and the majority answer (the first member of the largest
cluster) is correct when the reward scored that sample correct.

A completion is correct when the reward gives it at least ``threshold`` (1.0 for ``MathAccuracy``).
Prompts are rendered with the sampler's template. Sampling is seeded inside a forked RNG, so an
evaluation never changes the caller's random state; samples reproduce for the same seed,
``batch_size`` and hardware.

With ``sampler=`` (e.g. a :class:`~grpo_engine.tools.ToolSampler`: multi-turn rollouts with tools) that
sampler makes every completion instead: greedy ones with ``sample(..., temperature=0)`` (its token draw's
argmax at every turn), sampled ones at ``temperature``, each call's draws keyed by the rows' places among
all the evaluation's rows (so samples do not depend on ``batch_size``). Its own budgets apply (a
ToolSampler's ``max_completion_tokens`` counts the whole rollout, the environment's tokens included). The
reward scores the last turn's text and may read the episode and its environment, run as the trainer runs
rewards. With episodes, each item also records its rollouts' turns and tool calls (every call the model
wrote, run or not) and the report their means.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from grpo_engine.data.templates import PromptTemplate, default_template
from grpo_engine.ops.answers import answers_equal, final_answer
from grpo_engine.protocols import RewardFn, Sampler
from grpo_engine.rewards.runner import RewardRunner
from grpo_engine.sampling.decode import TokenDraw, completion_mask_from_ids, decode, is_decoder_lm, seeded_rng
from grpo_engine.sampling.hf import HFSampler, resolve_decoding
from grpo_engine.sampling.static import decode_static
from grpo_engine.types import Draws, Episode, Prompt

__all__ = ["EvalItem", "EvalReport", "EvalResult", "evaluate", "final_answer", "greedy_accuracy",
           "majority_vote", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples of which c are correct (Chen et al. 2021).

    ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which never
    forms the (huge) binomial coefficients.

    Args:
        n: samples drawn for the prompt (>= 1).
        c: correct samples among them (0 <= c <= n).
        k: the k of pass@k (1 <= k <= n).

    Returns:
        The probability that at least one of k samples drawn without replacement is correct.

    Raises:
        ValueError: a count is not an int, or the rule ``0 <= c <= n`` and ``1 <= k <= n`` fails.

    Example:
        >>> pass_at_k(5, 2, 2)  # 1 - C(3, 2) / C(5, 2) = 1 - 3/10
        0.7
        >>> pass_at_k(5, 0, 2), pass_at_k(5, 5, 2)
        (0.0, 1.0)
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"pass_at_k: {name}={value!r} must be an int (a count of samples)")
    if n < 1:
        raise ValueError(f"pass_at_k: n={n} must be >= 1; draw at least one sample per prompt")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} must be in [0, n={n}]; c counts the correct ones "
                         "among the n samples")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}]; the estimator needs at least k samples, "
                         f"so draw n >= {k} samples or lower k")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _clusters(answers: Sequence[str | None], equal: Callable[[str, str], bool]) -> list[list[int]]:
    """Indices of the non-None answers, grouped: an answer joins the first cluster whose first
    member is equal to it (identical strings always match), else starts a new cluster."""
    clusters: list[list[int]] = []
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        for cluster in clusters:
            head = answers[cluster[0]]
            if head == answer or equal(head, answer):
                cluster.append(i)
                break
        else:
            clusters.append([i])
    return clusters


def _winner(clusters: list[list[int]]) -> list[int] | None:
    # max() keeps the first of equal counts, and clusters are in order of first occurrence
    return max(clusters, key=len) if clusters else None


def majority_vote(
    answers: Sequence[str | None], equal: Callable[[str, str], bool] = answers_equal
) -> tuple[str | None, int]:
    """The most frequent answer, with answers clustered by ``equal``.

    Rules: None (no answer) never votes; an answer joins the first cluster whose first member
    it equals (``equal(first, answer)``, or the same string); the largest cluster wins and a tie
    goes to the cluster whose first member came first. The representative is that first member.

    Args:
        answers: extracted final answers, None where a completion has none.
        equal: the equivalence; by default math-verify's, as ``MathAccuracy`` uses.

    Returns:
        ``(representative, count)``, or ``(None, 0)`` when no answer was given.

    Example:
        >>> majority_vote(["1/2", None, "0.5", "3", r"\\frac{1}{2}", "3"])
        ('1/2', 3)
        >>> majority_vote([None, None])
        (None, 0)
    """
    winner = _winner(_clusters(answers, equal))
    return (answers[winner[0]], len(winner)) if winner else (None, 0)


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


@dataclass(frozen=True)
class EvalItem:
    """What one prompt got; greedy fields are None without greedy decoding, sampled ones empty
    without sampling.

    Attributes:
        question, target: the prompt's question text and reference answer.
        greedy_completion, greedy_answer, greedy_score, greedy_correct: the greedy completion, its
            final answer (``final_answer``), its reward and whether that is >= threshold.
        sampled_completions, sampled_answers, sampled_scores, sampled_correct: the same for each
            of the k samples, in sampling order.
        majority_answer, majority_count, majority_correct: the majority answer (``majority_vote``),
            its votes, and whether the sample it came from is correct (False when no sample answered).
        greedy_turns, greedy_tool_calls, greedy_conversation: with tools, the greedy rollout's model turns,
            its tool calls and its messages after the prompt (``Episode``); None single-turn.
        sampled_turns, sampled_tool_calls: with tools, each sample's turns and tool calls; empty otherwise.
    """

    question: str
    target: str | None
    greedy_completion: str | None = None
    greedy_answer: str | None = None
    greedy_score: float | None = None
    greedy_correct: bool | None = None
    sampled_completions: tuple[str, ...] = ()
    sampled_answers: tuple[str | None, ...] = ()
    sampled_scores: tuple[float, ...] = ()
    sampled_correct: tuple[bool, ...] = ()
    majority_answer: str | None = None
    majority_count: int = 0
    majority_correct: bool | None = None
    greedy_turns: int | None = None
    greedy_tool_calls: int | None = None
    greedy_conversation: tuple[Mapping[str, Any], ...] | None = None
    sampled_turns: tuple[int, ...] = ()
    sampled_tool_calls: tuple[int, ...] = ()


# with tools only: left out of a single-turn report's JSON, which stays as it was
_MULTI_TURN = ("greedy_turns", "greedy_tool_calls", "greedy_conversation", "sampled_turns",
               "sampled_tool_calls")


@dataclass(frozen=True)
class EvalReport:
    """Aggregates, per-prompt records and the exact settings of one evaluation.

    Attributes:
        num_prompts: n, the prompts evaluated.
        k: samples per prompt (1 and no sampling when only greedy decoding ran).
        greedy_pass_at_1: fraction of greedy completions correct, or None.
        sampled_pass_at_1: avg@k, the mean over prompts of c/k, or None without sampling.
        pass_at_k: mean unbiased pass@k (n = k samples), or None unless k > 1.
        maj_at_k: fraction of prompts whose majority answer is correct, or None unless k > 1.
        items: one ``EvalItem`` per prompt, in order.
        settings: template, temperature, max_new_tokens, k, seed, ... (JSON values; with tools also the
            tools, environment, parser and limits).
        seconds: wall-clock time of the evaluation.
        greedy_turns, greedy_tool_calls: with tools, the mean model turns and tool calls of a greedy
            rollout; None single-turn or without greedy decoding.
        sampled_turns, sampled_tool_calls: the same over the n * k sampled rollouts.
    """

    num_prompts: int
    k: int
    greedy_pass_at_1: float | None
    sampled_pass_at_1: float | None
    pass_at_k: float | None
    maj_at_k: float | None
    items: tuple[EvalItem, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    greedy_turns: float | None = None
    greedy_tool_calls: float | None = None
    sampled_turns: float | None = None
    sampled_tool_calls: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))

    @property
    def metrics(self) -> dict[str, float]:
        """The aggregates under their usual names: pass@1 (greedy), avg@k, pass@k, maj@k; with tools also
        ``turns/greedy``, ``tool_calls/greedy``, ``turns/sampled`` and ``tool_calls/sampled``."""
        named = (("pass@1", self.greedy_pass_at_1), (f"avg@{self.k}", self.sampled_pass_at_1),
                 (f"pass@{self.k}", self.pass_at_k), (f"maj@{self.k}", self.maj_at_k),
                 ("turns/greedy", self.greedy_turns), ("tool_calls/greedy", self.greedy_tool_calls),
                 ("turns/sampled", self.sampled_turns), ("tool_calls/sampled", self.sampled_tool_calls))
        return {name: value for name, value in named if value is not None}

    def table(self) -> str:
        """A short console table of the aggregates, with the size of one prompt in points."""
        n, k, s = self.num_prompts, self.k, self.settings
        rows = [("pass@1", self.greedy_pass_at_1, n, "greedy"),
                (f"avg@{k}", self.sampled_pass_at_1, n * k, f"pass@1 sampled, mean of {k}"),
                (f"pass@{k}", self.pass_at_k, n, "unbiased estimator"),
                (f"maj@{k}", self.maj_at_k, n, "majority answer")]
        decoding = "greedy" if self.sampled_pass_at_1 is None else f"temperature={s.get('temperature')}"
        lines = [f"eval: {n} prompts, k={k}, {decoding}, max_new_tokens={s.get('max_new_tokens')}, "
                 f"seed={s.get('seed')}",
                 f"{'metric':<9} {'value':>7} {'count':>11}"]
        for name, value, total, note in rows:
            if value is not None:
                count = f"{round(value * total)}/{total}"
                lines.append(f"{name:<9} {value:>7.4f} {count:>11}  {note}")
        for name, value in (("greedy", self.greedy_turns), ("sampled", self.sampled_turns)):
            if value is not None:
                calls = self.greedy_tool_calls if name == "greedy" else self.sampled_tool_calls
                lines.append(f"{name} rollouts: {value:.2f} turns, {calls:.2f} tool calls on average")
        lines.append(f"one prompt = {100 / n:.2f} points; {self.seconds:.1f} s")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the aggregates, ``metrics``, ``settings`` and ``items``."""
        out: dict[str, Any] = {"metrics": self.metrics}
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "items"
                    and not (f.name in _MULTI_TURN and getattr(self, f.name) is None)})
        out["settings"] = dict(self.settings)
        out["items"] = [{key: value for key, value in asdict(item).items()  # last: the long part
                         if not (key in _MULTI_TURN and value in (None, ()))} for item in self.items]
        return out

    def to_json(self, path: str | Path) -> Path:
        """Writes the report as JSON atomically (a temporary sibling file, then ``os.replace``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalReport:
        """Rebuilds a report from ``to_dict`` output (``metrics`` is derived and ignored)."""
        names = {f.name for f in fields(cls)} - {"items"}
        items = tuple(EvalItem(**{key: tuple(v) if isinstance(v, list) else v for key, v in item.items()})
                      for item in data["items"])
        return cls(items=items, **{key: data[key] for key in names if key in data})

    @classmethod
    def from_json(cls, path: str | Path) -> EvalReport:
        """Reads a report written by ``to_json``."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


@torch.no_grad()
def _greedy_completions(model: nn.Module, encoder: HFSampler, prompts: Sequence[Prompt],
                        max_new_tokens: int) -> list[str]:
    """Greedy completion texts (up to the first EOS) of the prompts, in one decoding call (argmax at
    every step; a model that is not a transformers causal LM decodes with its own generate())."""
    device = next(model.parameters()).device
    ids, mask = encoder.encode_prompts(prompts)
    ids, mask = ids.to(device), mask.to(device)
    was_training = model.training
    model.eval()
    try:
        if is_decoder_lm(model):
            path = resolve_decoding(encoder.decoding, model, device)
            kwargs = dict(repeats=1, max_new_tokens=max_new_tokens, eos_ids=encoder.eos_ids,
                          pad_id=encoder.pad_id, draw=TokenDraw(greedy=True, logprobs=False))
            if path == "dynamic":
                completion, _ = decode(model, ids, mask, **kwargs)
            else:
                completion, _ = decode_static(model, ids, mask, mode="eager" if path == "static" else path,
                                              **kwargs)
        else:
            out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=encoder.eos_ids,
                                 pad_token_id=encoder.pad_id, temperature=None, top_p=None, top_k=None)
            completion = out[:, ids.shape[1]:]
    finally:
        model.train(was_training)
    keep, _ = completion_mask_from_ids(completion, encoder.eos_ids)
    return encoder.tokenizer.batch_decode([row[m].tolist() for row, m in zip(completion, keep)],
                                          skip_special_tokens=True)


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
    """Greedy-decodes each prompt once and scores it (the greedy part of :func:`evaluate`).

    Args:
        model: the policy (LoRA-wrapped models work).
        tokenizer: its tokenizer.
        prompts: the held-out prompts, with targets.
        reward: scores a completion (e.g. ``MathAccuracy()``).
        template: the prompt template (default: the chat template when the tokenizer has one).
        max_new_tokens: generation limit.
        batch_size: prompts per decoding call.
        threshold: score at or above which a completion is correct.

    Returns:
        An ``EvalResult``.
    """
    if not prompts:
        raise ValueError("greedy_accuracy got no prompts; pass the held-out prompt list")
    encoder = HFSampler(model, tokenizer, template=template, max_prompt_tokens=10**9)
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        texts += _greedy_completions(model, encoder, prompts[start:start + batch_size], max_new_tokens)
    scores = reward(list(prompts), texts).tolist()
    correct = sum(s >= threshold for s in scores)
    return EvalResult(accuracy=correct / len(prompts), completions=tuple(texts), scores=tuple(scores))


def _completions(model: nn.Module, sampler: HFSampler, rollouts: Sampler | None, prompts: list[Prompt],
                 reward: RewardFn, *, k: int, greedy: bool, temperature: float, max_new_tokens: int,
                 batch_size: int, seed: int, bar: Any) -> tuple[list[str], list[float], list[Episode] | None]:
    """The texts, scores and episodes (None without) of every prompt's completions, prompt-major: one greedy
    completion each (``greedy``), or k sampled; in calls of ``batch_size`` completions; by ``rollouts``
    when given (module docstring)."""
    per_call = batch_size if greedy else max(1, batch_size // k)
    texts: list[str] = []
    scores: list[float] = []
    episodes: list[Episode] = []
    found = rollouts is not None  # every batch had episodes
    forked = seeded_rng(seed, next(model.parameters()).device) if rollouts or not greedy else nullcontext()
    with forked:
        for i in range(0, len(prompts), per_call):
            chunk = prompts[i:i + per_call]
            if rollouts is not None:  # the rows' draws keyed by their place among all rows
                batch = rollouts.sample(chunk, group_size=k, temperature=0.0 if greedy else temperature,
                                        draws=Draws(seed, first_prompt=i, total_prompts=len(prompts)))
                new, got = list(batch.texts), RewardRunner().scores(reward, batch)[0].tolist()
                found = found and batch.episodes is not None
                episodes += batch.episodes or ()
            elif greedy:
                new = _greedy_completions(model, sampler, chunk, max_new_tokens)
                got = reward(chunk, new).tolist()
            else:
                new = list(sampler.sample(chunk, group_size=k).texts)
                got = reward([p for p in chunk for _ in range(k)], new).tolist()
            texts += new
            scores += got
            bar.update(len(new))
    return texts, scores, episodes if found else None


def _item(prompt: Prompt, greedy: tuple[str, float, Episode | None] | None,
          sampled: tuple[list[str], list[float], list[Episode] | None] | None, threshold: float) -> EvalItem:
    """One prompt's record from its greedy completion (text, score, episode) and its k samples."""
    item: dict[str, Any] = {"question": prompt.question, "target": prompt.target}
    if greedy is not None:
        text, score, episode = greedy
        item.update(greedy_completion=text, greedy_answer=final_answer(text), greedy_score=float(score),
                    greedy_correct=float(score) >= threshold)
        if episode is not None:
            item.update(greedy_turns=episode.turns, greedy_tool_calls=len(episode.tool_calls),
                        greedy_conversation=tuple(dict(m) for m in episode.messages))
    if sampled is not None:
        texts, scores, episodes = sampled
        scores = [float(s) for s in scores]
        answers = [final_answer(t) for t in texts]
        correct = [s >= threshold for s in scores]
        winner = _winner(_clusters(answers, answers_equal))
        item.update(sampled_completions=tuple(texts), sampled_answers=tuple(answers),
                    sampled_scores=tuple(scores), sampled_correct=tuple(correct),
                    majority_answer=answers[winner[0]] if winner else None,
                    majority_count=len(winner) if winner else 0,
                    majority_correct=correct[winner[0]] if winner else False)
        if episodes is not None:
            item.update(sampled_turns=tuple(e.turns for e in episodes),
                        sampled_tool_calls=tuple(len(e.tool_calls) for e in episodes))
    return EvalItem(**item)


def _sampler_record(sampler: Sampler) -> dict[str, Any]:
    """The report's settings of a given sampler: its class, and what it says of its budgets and tools."""
    base = getattr(sampler, "base", sampler)  # a ToolSampler's single-turn sampler
    tools = [schema["function"]["name"] for schema in getattr(sampler, "schemas", ())]  # environments too
    factory = getattr(sampler, "environment_factory", None)
    parser = getattr(sampler, "parser", None)
    return {"sampler": type(sampler).__name__, "max_new_tokens": getattr(base, "max_completion_tokens", None),
            "max_prompt_tokens": getattr(base, "max_prompt_tokens", None),
            "top_p": getattr(base, "top_p", None), "top_k": getattr(base, "top_k", None), "tools": tools,
            "environment": None if factory is None else getattr(factory, "__qualname__", repr(factory)),
            "parser": None if parser is None else type(parser).__name__,
            "max_turns": getattr(sampler, "max_turns", None)}


def evaluate(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Prompt],
    reward: RewardFn,
    *,
    template: PromptTemplate | None = None,
    k: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    seed: int = 0,
    greedy: bool = True,
    threshold: float = 1.0,
    progress: bool = True,
    sampler: Sampler | None = None,
) -> EvalReport:
    """Greedy pass@1 and, with k samples per prompt, avg@k, pass@k and maj@k (module docstring); of
    multi-turn rollouts with tools when ``sampler`` is a ``ToolSampler``.

    Args:
        model: the policy (LoRA-wrapped models work); its train/eval mode is restored.
        tokenizer: its tokenizer.
        prompts: the held-out prompts, each with its ``target``.
        reward: decides correctness of a completion (e.g. ``MathAccuracy()``); with tools it may read the
            episode and the environment, as in training (``FunctionReward``'s ``environments``).
        template: the prompt template (default: the chat template when the tokenizer has one; tools need
            a chat template).
        k: samples per prompt; sampling runs when k > 1 or ``greedy`` is False.
        temperature: sampling temperature (top-p and top-k off).
        max_new_tokens: generation limit, greedy and sampled (not with ``sampler``: its own applies).
        batch_size: completions per decoding call (greedy: prompts; sampled: ``batch_size // k``
            prompts, at least one, times k).
        seed: seeds the sampling (in a forked RNG; the caller's random state is untouched).
        greedy: also decode greedily (pass@1).
        threshold: a score at or above this is correct.
        progress: show a tqdm bar counting completions.
        sampler: makes the completions instead of evaluate's own decoding (its ``sample(prompts,
            group_size=, temperature=, draws=)``; temperature 0 for the greedy ones): a
            :class:`~grpo_engine.tools.ToolSampler` for multi-turn rollouts with tools (the trainer passes
            its own), or any ``Sampler``. ``model`` is still the policy whose device seeds the draws.

    Returns:
        An ``EvalReport``; ``report.metrics`` has ``pass@1`` and, when sampled, ``avg@k``
        (and ``pass@k``, ``maj@k`` when k > 1); with tools also the mean turns and tool calls.

    Raises:
        ValueError: no prompts, a count that is not an int >= 1, or sampling at a temperature <= 0.

    Example:
        >>> # report = evaluate(model, tokenizer, load_gsm8k(path, limit=50), MathAccuracy(), k=4)
        >>> # print(report.table()); report.to_json("gsm8k.json")
        >>> # tools = ToolSampler(HFSampler(model, tokenizer, max_completion_tokens=512), tools=[multiply])
        >>> # evaluate(model, tokenizer, prompts, MathAccuracy(), sampler=tools, k=8).metrics["pass@8"]
    """
    if not prompts:
        raise ValueError("evaluate() got no prompts; pass the held-out prompt list")
    for name, value in (("k", k), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"evaluate(): {name}={value!r} must be an int >= 1")
    sample = k > 1 or not greedy
    if sample and not temperature > 0:
        raise ValueError(f"evaluate(): temperature={temperature!r} must be > 0 to sample; "
                         "use greedy=True with k=1 for deterministic decoding")
    start_time = time.perf_counter()
    prompts = list(prompts)
    template = template if template is not None else default_template(tokenizer)
    rollouts = sampler
    sampler = HFSampler(model, tokenizer, template=template, max_prompt_tokens=10**9,
                        max_completion_tokens=max_new_tokens, temperature=temperature, return_logprobs=False)
    total = len(prompts) * (int(greedy) + (k if sample else 0))
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="eval", unit="completion", disable=not progress, dynamic_ncols=True)
    run = dict(temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
               bar=bar)
    try:
        greedy_run = (_completions(model, sampler, rollouts, prompts, reward, k=1, greedy=True, **run)
                      if greedy else None)
        sampled_run = (_completions(model, sampler, rollouts, prompts, reward, k=k, greedy=False, **run)
                       if sample else None)
    finally:
        bar.close()

    items = tuple(_item(
        prompt,
        None if greedy_run is None else (greedy_run[0][i], greedy_run[1][i],
                                         None if greedy_run[2] is None else greedy_run[2][i]),
        None if sampled_run is None else tuple(None if part is None else part[i * k:(i + 1) * k]
                                               for part in sampled_run),
        threshold) for i, prompt in enumerate(prompts))
    n = len(items)
    mean = lambda values: sum(values) / n
    multi = sample and k > 1
    example = (template.render(prompts[0], tokenizer) if rollouts is None  # with tools: the tools' prompt
               else tokenizer.decode(rollouts.prompt_tokens(prompts[0]), skip_special_tokens=False))
    settings = {
        "template": repr(template), "example_prompt": example,
        "reward": getattr(reward, "name", type(reward).__name__), "threshold": threshold,
        "greedy": greedy, "k": k, "temperature": temperature if sample else None, "top_p": 1.0, "top_k": 0,
        "max_new_tokens": max_new_tokens, "batch_size": batch_size, "seed": seed, "num_prompts": n,
    }
    turns: dict[str, float | None] = {}
    if rollouts is not None:
        settings.update(_sampler_record(rollouts))
    if any(done is not None and done[2] is not None for done in (greedy_run, sampled_run)):
        for name in ("turns", "tool_calls"):
            turns[f"greedy_{name}"] = (mean([getattr(it, f"greedy_{name}") for it in items])
                                       if greedy else None)
            turns[f"sampled_{name}"] = (mean([sum(getattr(it, f"sampled_{name}")) / k for it in items])
                                        if sample else None)
    return EvalReport(
        num_prompts=n, k=k,
        greedy_pass_at_1=mean([it.greedy_correct for it in items]) if greedy else None,
        sampled_pass_at_1=mean([sum(it.sampled_correct) / k for it in items]) if sample else None,
        pass_at_k=mean([pass_at_k(k, sum(it.sampled_correct), k) for it in items]) if multi else None,
        maj_at_k=mean([bool(it.majority_correct) for it in items]) if multi else None,
        items=items, settings=settings, seconds=time.perf_counter() - start_time, **turns,
    )
