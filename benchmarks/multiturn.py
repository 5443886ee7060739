"""Multi-turn tool rollouts at 1, 3 and 5 turns: contexts re-prefilled, the KV cache kept, vLLM (issue 54).

    python benchmarks/multiturn.py [--turns 1 3 5] [--rounds 2] [--arms reprefill cached vllm]
        [--out benchmarks/results/<date>-multiturn.json] [--quick]

Three arms, each a ``ToolSampler`` over SmolLM2-135M-Instruct (float32, the CPU) with the same settings:
``reprefill`` (``kv_cache=False``: each turn prefills every row's whole context, today's path), ``cached``
(``kv_cache=True``: a turn after a tool reply prefills only the reply's tokens) and ``vllm`` (a colocated
``VLLMSampler`` generates each turn from the exact token ids, prefix caching on; its worker runs under
``--vllm-python``, default ``.venv-vllm/bin/python``, and the arm is skipped when that cannot import vllm).

The shape: ``--prompts`` x ``--group-size`` rows a step; each prompt a system message holding a generated
shipping log (``--prompt-tokens``, about 1,000, tools' description included) and a question; the parser
reads a call to the one tool, ``lookup``, in every turn, so each rollout runs exactly T turns (the last
turn's call is parsed, not run: ``turn_limit``); a turn ends at the model's EOS or at ``--stop-text``
(default ``"."``, the end of its first sentence: turns of the model's own length); the tool replies
``--reply-chars`` characters of text. Each worker (one per arm and round, rounds rotated, on the shared
harness) samples a short warm-up (vLLM starts its engine there), then for each T ``--calls`` timed
``sample()`` calls, each with the same seed in every arm (so ``reprefill`` and ``cached`` sample the same
tokens). Before each vLLM call its prefix cache is emptied, as the weight sync of a training step does.

Reported per arm and T: the prompt P, the model's tokens per turn ``c_model`` and the tool reply's per turn
``c_env`` (measured), prefill tokens per row (``turns/prefill_tokens``; for vLLM also what its engine
prefilled, the contexts less their prefix-cache hits), the formula's prediction (re-prefill T·P + c·T(T−1)/2
with c = c_model + c_env; cached P + c_env·(T−1)) and the exact count from each row's turns, the median wall
time of ``sample()``, and the decode steps a row waits per turn for the turn's slowest row (``wait``; the
report also has the turns' steps in step and the slowest row's on its own). Per T: re-prefill's prefill over
each other arm's, and each arm's wall time over re-prefill's; the issue's goals at the largest T (>= 3x fewer
prefill tokens, <= 0.6x the wall time). A summary table on stdout, the full report (every call) in ``--out``,
rewritten after each worker, and the workers' log beside it. Exit status 1 when a worker failed or a check
did not hold (a row not run for exactly T turns, the two decoding paths' tokens differing, a prefill count
off the rows' own turns). Run it alone: the CPU cores are the measurement. ``--quick``: a random-init
2-layer model on SmolLM2's tokenizer, 1 prompt x 2, a short prompt, T = 1 and 2, one round (the test's).

The defaults (2 prompts x 2, 1,000-token prompts, replies of 480 characters, 2 rounds) are sized to take
about 6 minutes on 2 idle cores; ``--group-size 4`` about doubles it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as harness

ARMS = ("reprefill", "cached", "vllm")
TOOL_TEXT = ("Lookup result: the log lists 42 matching lines; the largest shipment was 96 crates of copper "
             "wire, sent from dock 3 on a Tuesday by the north team. ")
QUESTIONS = ("Which team moved the most crates in the log? Look it up before you answer.",
             "Which dock sent copper wire most often? Look it up before you answer.")
# --quick: a random-init 2-layer model on SmolLM2's tokenizer (tiny_model), one round, turns ended at a space
QUICK = dict(turns=(1, 2), prompts=1, group_size=2, prompt_tokens=120, reply_chars=80, stop_text=" ",
             max_completion_tokens=400, calls=1, threads=1)
WORKER_LIMIT_S = 600.0


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one worker runs."""

    model: str  # a transformers folder (the demo's SmolLM2-135M-Instruct)
    arm: str = "cached"
    round: int = 0
    turns: tuple[int, ...] = (1, 3, 5)
    prompts: int = 2
    group_size: int = 2
    prompt_tokens: int = 1000  # the rendered prompt, tools' description included (at least this many)
    reply_chars: int = 480
    stop_text: str = "."
    max_completion_tokens: int = 1536  # the whole rollout's budget: model and tool tokens
    calls: int = 1  # timed sample() calls per T
    seed: int = 0
    threads: int = 0  # torch intra-op threads in the worker (0: torch's default, every core)


# -- the rollouts' shape: a document, a tool, a parser for which every turn calls it ------------------------


def document(sentences: int, seed: int = 0) -> str:
    """A shipping log of ``sentences`` generated sentences (the same for a seed).

    Example:
        >>> document(1)
        'On Thursday the west team moved 7 crates of rice from dock 8 to warehouse 7.'
    """
    rng = random.Random(seed)
    days = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
    teams = ("north", "south", "east", "west", "night")
    items = ("copper wire", "glass jars", "rice", "engine parts", "paper", "olive oil")
    return " ".join(f"On {rng.choice(days)} the {rng.choice(teams)} team moved {rng.randrange(2, 99)} crates "
                    f"of {rng.choice(items)} from dock {rng.randrange(1, 9)} to warehouse "
                    f"{rng.randrange(1, 9)}." for _ in range(sentences))


def lookup_tool(chars: int):
    """The benchmark's tool: whatever it is asked, ``chars`` characters of text."""
    text = (TOOL_TEXT * (chars // len(TOOL_TEXT) + 1))[:chars]

    def lookup(query: str) -> str:
        """Looks the query up in the shipping log.

        Args:
            query: what to look up.
        """
        return text

    return lookup


class EveryTurnCalls:
    """A tool-call parser for which every turn calls ``lookup`` (so a rollout runs exactly ``max_turns``
    turns); a turn ends at ``stop_text`` ("": at EOS only)."""

    def __init__(self, stop_text: str) -> None:
        self.stop_text = stop_text or None

    def parse(self, text: str) -> list[dict[str, Any]]:
        return [{"name": "lookup", "arguments": {"query": "crates"}}]

    def system_prompt(self, schemas: Sequence[Any]) -> str:
        return "You can look things up in the log with the tool lookup(query)."


def make_prompts(sampler, spec: Spec) -> list:
    """``spec.prompts`` prompts, a system message with the log and a question, the log's length the least
    whose rendered prompt (tools included) reaches ``spec.prompt_tokens``."""
    from grpo_engine.types import Prompt

    def prompts(sentences: int) -> list:
        system = ("You answer questions about the shipping log below, in short sentences.\n\n"
                  + document(sentences, spec.seed))
        return [Prompt(({"role": "system", "content": system},
                        {"role": "user", "content": QUESTIONS[b % len(QUESTIONS)]}))
                for b in range(spec.prompts)]

    low, high = 0, 1
    while len(sampler.prompt_tokens(prompts(high)[0])) < spec.prompt_tokens:
        low, high = high, 2 * high
    while high - low > 1:  # the least count whose first prompt is long enough
        middle = (low + high) // 2
        low, high = (middle, high) if len(sampler.prompt_tokens(prompts(middle)[0])) < spec.prompt_tokens \
            else (low, middle)
    return prompts(high)


# -- counting -----------------------------------------------------------------------------------------------


def turn_runs(completion_mask, env_mask) -> list[tuple[list[int], list[int]]]:
    """Each row's model tokens per turn and the environment's tokens after each turn, from a batch's masks
    ([N, C] bool each).

    Example:
        >>> import torch
        >>> turn_runs(torch.tensor([[1, 1, 1, 1, 1, 0]]).bool(), torch.tensor([[0, 1, 1, 0, 0, 0]]).bool())
        [([1, 2], [2])]
    """
    out = []
    for keep, env in zip(completion_mask, env_mask):
        flags = env[keep].tolist()
        model, replies, k = [], [], 0
        while k < len(flags):
            start = k
            while k < len(flags) and not flags[k]:
                k += 1
            model.append(k - start)
            start = k
            while k < len(flags) and flags[k]:
                k += 1
            if k > start:
                replies.append(k - start)
        out.append((model, replies))
    return out


def exact_prefill(prompt: int, model: Sequence[int], env: Sequence[int], *, cached: bool) -> int:
    """The context tokens a row's turns prefill, from its own turns: re-prefilled, each turn's whole context
    (the prompt, then every earlier turn and reply); cached, the prompt and the replies that a later turn
    reads (the tokens the row sampled are in its cache already).

    Example:
        >>> exact_prefill(10, [3, 2, 4], [5, 6], cached=False)  # 10 + (10 + 3 + 5) + (18 + 2 + 6)
        54
        >>> exact_prefill(10, [3, 2, 4], [5, 6], cached=True)  # 10 + 5 + 6
        21
    """
    if not cached:
        contexts = [prompt + sum(model[:t]) + sum(env[:t]) for t in range(len(model))]
        return sum(contexts)
    return prompt + sum(env[:len(model) - 1])


def predicted_prefill(turns: int, prompt: float, c_model: float, c_env: float, *, cached: bool) -> float:
    """The formula's prefill tokens per row over ``turns`` turns, for turns of ``c_model`` model tokens
    and replies of ``c_env``: T·P + c·T(T−1)/2 (c = c_model + c_env) re-prefilled, P + c_env·(T−1) cached.

    Example:
        >>> [predicted_prefill(5, 1000, 30, 120, cached=cached) for cached in (False, True)]
        [6500.0, 1480.0]
    """
    if cached:
        return float(prompt + c_env * (turns - 1))
    return float(turns * prompt + (c_model + c_env) * turns * (turns - 1) / 2)


def waiting(model_runs: Sequence[Sequence[int]]) -> dict[str, float]:
    """What decoding the rows in step costs, from each row's model tokens per turn: the decode steps a row
    waits per turn for the turn's slowest row, the steps the turns take in step, and the steps of the slowest
    row on its own (what rows proceeding independently would need).

    Example:
        >>> waiting([[3, 1], [1, 2]])  # turn 1: 3 steps, row 2 waits 2; turn 2: 2 steps, row 1 waits 1
        {'wait_steps_per_turn': 0.75, 'lockstep_steps': 5, 'alone_steps': 4}
    """
    waits, lockstep = [], 0
    for t in range(max(map(len, model_runs))):
        here = [runs[t] for runs in model_runs if len(runs) > t]
        lockstep += max(here)
        waits += [max(here) - n for n in here]
    return {"wait_steps_per_turn": sum(waits) / len(waits), "lockstep_steps": lockstep,
            "alone_steps": max(map(sum, model_runs))}


def rollout_shape(batch, turns: int, arm: str) -> dict[str, Any]:
    """What one step's rollouts held: P, c_model, c_env, turns and ends, prefill tokens per row (measured,
    exact from the rows' turns, predicted), the cost of decoding in step (:func:`waiting`), and a digest of
    the sampled tokens."""
    rows = batch.completion_mask.shape[0]
    prompts = batch.prompt_mask.sum(1).tolist()
    runs = turn_runs(batch.completion_mask.cpu(), batch.env_mask.cpu())
    model_turns = sum(len(m) for m, _ in runs)
    replies = sum(len(e) for _, e in runs)
    p = sum(prompts) / rows
    c_model = sum(sum(m) for m, _ in runs) / model_turns
    c_env = sum(sum(e) for _, e in runs) / replies if replies else 0.0
    cached = arm != "reprefill"
    digest = hashlib.sha1()
    for ids, keep in zip(batch.completion_ids.cpu(), batch.completion_mask.cpu()):
        digest.update(str(ids[keep].tolist()).encode())
    exact = [exact_prefill(n, m, e, cached=cached) for n, (m, e) in zip(prompts, runs)]
    ends = {k.removeprefix("ends/"): v for k, v in batch.metrics.items() if k.startswith("ends/") and v}
    return {"turns": turns, "rows": rows, "prompt_tokens": p, "c_model": c_model, "c_env": c_env,
            "turns_per_row": [len(m) for m, _ in runs], "ends": ends,
            "prefill_per_row": batch.metrics["turns/prefill_tokens"] / rows,
            "exact_per_row": sum(exact) / rows,
            "predicted_per_row": predicted_prefill(turns, p, c_model, c_env, cached=cached),
            "model_tokens_per_row": sum(sum(m) for m, _ in runs) / rows, **waiting([m for m, _ in runs]),
            "tokens_sha1": digest.hexdigest()[:16]}


# -- the worker ---------------------------------------------------------------------------------------------


def _samplers(spec: Spec, model, tokenizer):
    """The arm's single-turn sampler and a function making its ToolSampler for T turns."""
    from grpo_engine.data import ChatTemplate
    from grpo_engine.sampling import HFSampler
    from grpo_engine.tools import ToolSampler

    settings = dict(template=ChatTemplate(), max_prompt_tokens=spec.prompt_tokens + 512,
                    max_completion_tokens=spec.max_completion_tokens)
    if spec.arm == "vllm":
        from grpo_engine.sampling.vllm import VLLMSampler

        base = VLLMSampler(model, tokenizer, engine_model=spec.model, engine_kwargs={"enforce_eager": True},
                           **settings)
    else:
        base = HFSampler(model, tokenizer, **settings)
    kv_cache = {"reprefill": False, "cached": True, "vllm": None}[spec.arm]

    def tool_sampler(turns: int):
        return ToolSampler(base, tools=[lookup_tool(spec.reply_chars)], parser=EveryTurnCalls(spec.stop_text),
                           max_turns=turns, kv_cache=kv_cache)

    return base, tool_sampler


def _spy(engine, seen: list[tuple[int, int]]) -> None:
    """Records (context tokens, prefix-cache hits) of every request the vLLM engine answers."""
    generate = engine.generate

    def spied(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        seen.extend((len(out.prompt_token_ids), out.num_cached_tokens or 0) for out in outputs)
        return outputs

    engine.generate = spied


def run_arm(spec: Spec) -> dict[str, Any]:
    """One worker: a warm-up, then each T's timed ``sample()`` calls; the partial result after each T."""
    import torch

    from grpo_engine.models import load_model
    from grpo_engine.types import Draws, Prompt

    started = time.perf_counter()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    model, tokenizer = load_model(spec.model)
    base, tool_sampler = _samplers(spec, model, tokenizer)
    result: dict[str, Any] = {"arm": spec.arm, "round": spec.round, "threads": torch.get_num_threads(),
                              "versions": {**harness.versions(), "vllm": _vllm_version()}, "by_turns": []}
    warm = Prompt(({"role": "user", "content": "Say hello."},))
    tool_sampler(2).sample([warm], group_size=1, temperature=1.0, draws=Draws(seed=spec.seed))
    seen: list[tuple[int, int]] = []
    if spec.arm == "vllm":
        _spy(base.engine, seen)
    prompts = make_prompts(tool_sampler(1), spec)
    result["warm_s"] = time.perf_counter() - started
    for turns in spec.turns:
        sampler, seconds, engine = tool_sampler(turns), [], []
        for _ in range(spec.calls):
            if spec.arm == "vllm":
                base.engine.reset_prefix_cache()  # as a training step's weight sync does
            seen.clear()
            start = time.perf_counter()
            batch = sampler.sample(prompts, group_size=spec.group_size, temperature=1.0,
                                   draws=Draws(seed=spec.seed + turns))
            seconds.append(time.perf_counter() - start)
            engine.append(sum(n - hits for n, hits in seen) / batch.completion_ids.shape[0])
        result["by_turns"].append({**rollout_shape(batch, turns, spec.arm), "sample_s": seconds,
                                   "engine_prefill_per_row": engine[-1] if spec.arm == "vllm" else None})
        harness.emit_partial(result)
    if spec.arm == "vllm":
        base.close()
    return result


def _vllm_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        return None


# -- the parent ---------------------------------------------------------------------------------------------


def tiny_model(source: str, folder: Path) -> str:
    """A random-init 2-layer Llama with the tokenizer and chat template of ``source`` (a transformers
    folder), saved in ``folder`` for every worker (vLLM's too) to load: ``--quick``'s model."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(source)
    config.update(dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=64))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return str(folder)


def vllm_missing(python: str) -> str | None:
    """None when ``python`` can import vllm, else why the vLLM arm is skipped."""
    if not Path(python).exists():
        return f"{python} does not exist (make vllm-venv)"
    probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                                          "sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, timeout=60)
    return None if probe.returncode == 0 else f"{python} cannot import vllm (make vllm-venv)"


def summarize(runs: Sequence[dict], arms: Sequence[str], turns: Sequence[int]) -> dict[str, Any]:
    """Per arm and T: the shape and prefill of the first run (every round samples the same rows, but
    vLLM's batching may change a draw), and the median ``sample()`` time over every run's calls."""
    summary: dict[str, Any] = {}
    for arm in arms:
        for t in turns:
            found = [b for r in runs if r["arm"] == arm for b in r["by_turns"] if b["turns"] == t]
            if not found:
                continue
            seconds = [s for b in found for s in b["sample_s"]]
            summary.setdefault(arm, {})[str(t)] = {
                **{k: v for k, v in found[0].items() if k != "sample_s"},
                "sample_s_median": harness.median(seconds), "sample_s": seconds}
    return summary


def ratios(summary: dict[str, Any], turns: Sequence[int]) -> dict[str, Any]:
    """Per T: re-prefill's prefill tokens over the cached path's and vLLM's (its engine's), and the cached
    path's and vLLM's wall time over re-prefill's."""
    out: dict[str, Any] = {}
    for t in map(str, turns):
        base = summary.get("reprefill", {}).get(t)
        if base is None:
            continue
        row: dict[str, float] = {}
        for arm in ("cached", "vllm"):
            other = summary.get(arm, {}).get(t)
            if other is None:
                continue
            prefill = other["engine_prefill_per_row"] if arm == "vllm" else other["prefill_per_row"]
            row[f"prefill_reprefill_over_{arm}"] = base["prefill_per_row"] / prefill
            row[f"wall_{arm}_over_reprefill"] = other["sample_s_median"] / base["sample_s_median"]
        out[t] = row
    return out


def checks(runs: Sequence[dict], spec: Spec) -> list[str]:
    """What must hold: every row ran exactly T turns; our two paths counted the prefill their rows' turns
    imply and sampled the same tokens."""
    problems, digests = [], {}
    for r in runs:
        for b in r["by_turns"]:
            where = f"{r['arm']} round {r['round']} T={b['turns']}"
            if b["turns_per_row"] != [b["turns"]] * b["rows"]:
                problems.append(f"{where}: turns per row {b['turns_per_row']}, not {b['turns']} each (ends "
                                f"{b['ends']}): raise --max-completion-tokens or set a --stop-text")
            if r["arm"] != "vllm" and b["prefill_per_row"] != b["exact_per_row"]:
                problems.append(f"{where}: {b['prefill_per_row']} prefill tokens per row logged, "
                                f"{b['exact_per_row']} by the rows' turns")
            if r["arm"] != "vllm":
                digests.setdefault(b["turns"], set()).add(b["tokens_sha1"])
    problems += [f"T={t}: the re-prefill and cached runs sampled different tokens ({sorted(d)})"
                 for t, d in digests.items() if len(d) > 1]
    return problems


def goals(table: dict[str, Any], turns: Sequence[int]) -> dict[str, Any]:
    """The issue's goals at the largest T: >= 3x fewer prefill tokens, <= 0.6x the wall time (cached)."""
    t = str(max(turns))
    row = table.get(t, {})
    fewer, wall = row.get("prefill_reprefill_over_cached"), row.get("wall_cached_over_reprefill")
    return {"turns": int(t), "prefill_fewer": fewer,
            "prefill_goal_met": None if fewer is None else fewer >= 3,
            "wall_ratio": wall, "wall_goal_met": None if wall is None else wall <= 0.6}


def benchmark(base: Spec, arms: Sequence[str], rounds: int, out: Path | None, budget_s: float,
              vllm_python: str) -> dict[str, Any]:
    """Runs every (round, arm) worker, round k's arms rotated to start at arm k; returns the report
    (rewritten in ``out`` after each worker, its workers' log beside it)."""
    runs: list[dict] = []
    errors: list[str] = []
    skipped: dict[str, str] = {}
    why = vllm_missing(vllm_python) if "vllm" in arms else None
    if why:
        skipped["vllm"] = why
        harness.say("multiturn", f"vllm skipped: {why}")
    arms = [a for a in arms if a not in skipped]
    end, started = time.time() + budget_s, time.perf_counter()
    log = out.with_suffix(".log") if out is not None else None
    if log is not None:
        log.write_text("")  # this run's workers only

    def report() -> dict[str, Any]:
        summary = summarize(runs, arms, base.turns)
        table = ratios(summary, base.turns)
        return {"benchmark": "multiturn", "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "date": time.strftime("%Y-%m-%d"), "hardware": harness.hardware("cpu"),
                "versions": harness.versions(), "commit": harness.git_commit(),
                "spec": {k: v for k, v in dataclasses.asdict(base).items() if k not in ("arm", "round")},
                "arms": list(arms), "rounds": rounds, "summary": summary, "ratios": table,
                "goals": goals(table, base.turns), "problems": checks(runs, base), "errors": list(errors),
                "skipped": skipped, "wall_s": time.perf_counter() - started, "runs": runs}

    for k, arm in harness.schedule(arms, range(rounds), rotate=True):
        limit = harness.time_limit(WORKER_LIMIT_S, end)
        if limit is None:
            errors.append(f"{arm} round {k}: not started, --budget-s {budget_s:.0f} ran out")
            continue
        harness.say("multiturn", f"round {k}: {arm}")
        spec = dataclasses.replace(base, arm=arm, round=k)
        env = harness.worker_env(VLLM_CPU_KVCACHE_SPACE=harness.os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        result, error = harness.run_worker(
            f"{arm}-{k}", [str(Path(__file__).resolve()), "--worker", json.dumps(dataclasses.asdict(spec))],
            limit, env, log, python=vllm_python if arm == "vllm" else sys.executable)
        if result is not None:
            runs.append(result)
        if error:
            errors.append(error)
            harness.say("multiturn", error)
        if out is not None:
            harness.write_report(out, report())
    return report()


def table(report: dict[str, Any]) -> str:
    """The summary table: per arm and T, then the ratios and the goals."""
    head = (f"{'arm':10}{'T':>3}{'P':>7}{'c_model':>9}{'c_env':>7}{'prefill/row':>13}{'exact':>9}"
            f"{'formula':>9}{'engine':>9}{'wait':>6}{'sample_s':>10}")
    lines = [head]
    for arm, by_turns in report["summary"].items():
        for t, s in by_turns.items():
            engine = s["engine_prefill_per_row"]
            engine = f"{engine:9.0f}" if engine is not None else f"{'-':>9}"
            lines.append(f"{arm:10}{t:>3}{s['prompt_tokens']:7.0f}{s['c_model']:9.1f}{s['c_env']:7.1f}"
                         f"{s['prefill_per_row']:13.0f}{s['exact_per_row']:9.0f}{s['predicted_per_row']:9.0f}"
                         f"{engine}{s['wait_steps_per_turn']:6.1f}{s['sample_s_median']:10.2f}")
    for t, row in report["ratios"].items():
        lines.append(f"T={t}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    g = report["goals"]
    if g["prefill_fewer"] is not None:
        lines.append(f"goals at T={g['turns']}: prefill {g['prefill_fewer']:.2f}x fewer (>= 3: "
                     f"{g['prefill_goal_met']}), wall {g['wall_ratio']:.2f}x (<= 0.6: {g['wall_goal_met']})")
    lines += [f"SKIPPED {arm}: {why}" for arm, why in report["skipped"].items()]
    lines += [f"PROBLEM: {x}" for x in report["problems"]] + [f"ERROR: {x}" for x in report["errors"]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="default: all three")
    parser.add_argument("--turns", nargs="+", type=int, default=[1, 3, 5], help="T values (default 1 3 5)")
    parser.add_argument("--rounds", type=int, default=2, help="workers per arm, rotated (default 2)")
    parser.add_argument("--calls", type=int, default=1, help="timed sample() calls per worker and T")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--reply-chars", type=int, default=480)
    parser.add_argument("--stop-text", default=".", help='ends a turn ("": EOS only)')
    parser.add_argument("--max-completion-tokens", type=int, default=1536, help="the whole rollout's budget")
    parser.add_argument("--model", help="a transformers folder (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--vllm-python", default=str(harness.ROOT / ".venv-vllm" / "bin" / "python"),
                        help="the interpreter of the vLLM arm's worker (default .venv-vllm/bin/python)")
    parser.add_argument("--budget-s", type=float, default=720.0, help="start no worker after this (s)")
    parser.add_argument("--out", type=Path, help="the JSON report (default benchmarks/results/<date>-"
                                                 "multiturn.json; none with --quick)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: every core)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and model, one round: the test's")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        fields = json.loads(args.worker)
        harness.emit(run_arm(Spec(**{**fields, "turns": tuple(fields["turns"])})))
        return 0
    counts = {"--rounds": args.rounds, "--calls": args.calls, "--prompts": args.prompts,
              "--group-size": args.group_size, **{f"--turns {t}": t for t in args.turns}}
    bad = [f"{k} {v}" if not k.startswith("--turns") else k for k, v in counts.items() if v < 1]
    if bad:
        parser.error(f"{', '.join(bad)}: each must be >= 1")
    if args.model is None:
        from grpo_engine.demo import smollm2_folder

        try:
            args.model = str(smollm2_folder())
        except RuntimeError as error:
            parser.error(str(error))
    base = Spec(model=args.model, turns=tuple(args.turns), prompts=args.prompts, group_size=args.group_size,
                prompt_tokens=args.prompt_tokens, reply_chars=args.reply_chars, stop_text=args.stop_text,
                max_completion_tokens=args.max_completion_tokens, calls=args.calls, threads=args.threads)
    dated = harness.ROOT / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}-multiturn.json"
    out = args.out or (None if args.quick else dated)
    arms = list(dict.fromkeys(args.arms))
    with tempfile.TemporaryDirectory(prefix="multiturn-") as scratch:
        if args.quick:
            base = dataclasses.replace(base, model=tiny_model(base.model, Path(scratch)), **QUICK)
        report = benchmark(base, arms, 1 if args.quick else args.rounds, out, args.budget_s, args.vllm_python)
    print(table(report), flush=True)
    keys = ("ratios", "goals", "problems", "errors", "skipped")
    print(json.dumps({k: report[k] for k in keys}), flush=True)
    return 1 if report["problems"] or report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
