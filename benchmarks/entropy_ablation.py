"""Entropy ablation: does each use of entropy help GRPO on the embedded demo task?

One arm per entropy use, each trained from the same base model, on the same data order, with the
same training seed and the same budget in optimizer steps, each (arm, seed) in a fresh process:

- ``baseline``: the demo recipe, no entropy use.
- ``entropy_scaled``: ``EntropyScaled()`` advantage (SEED-GRPO style: the group z-score scaled by
  ``max(1 - SE_norm, 0)``) fed by ``SemanticEntropy(normalize=True)``.
- ``top_entropy_tokens``: ``ClippedSurrogate(top_entropy_quantile=0.2)``: the surrogate is trained
  on the top-20% tokens by entropy of each micro-batch only ("Beyond the 80/20 rule").
- ``adaptive_temperature``: ``AdaptiveTemperature(initial=<the demo's temperature>)`` (defaults
  otherwise: bounds 0.5-1.5, step 0.05, collapse SE <= 0.1, scatter mean SE >= 0.8).
- ``curriculum``: ``grpo_engine.data.InformativeCurriculum(train, batch_size=B, seed=<training seed>)``
  (defaults otherwise: revisit up to half of each batch from prompts with mean accuracy in (0.1, 0.9)).

    python benchmarks/entropy_ablation.py --seeds 0 1 --steps 30 --out /tmp/ablation
    python benchmarks/entropy_ablation.py --arms baseline curriculum --seeds 0 --steps 10

The task and recipe are the demo's (``grpo_engine.demo.DemoSettings``) as they were when the
ablation was measured: SmolLM2-135M-Instruct
with LoRA r 16 / alpha 32, ``arithmetic_task(1000, 64, seed=0)``, the chat template with " Reply
with only the final number.", ``MathAccuracy``, B = 4 prompts x G = 8 completions per step (the
demo now runs 8 x 4), 16 completion tokens, temperature 1.0, lr 3e-4 constant, micro-batch 16,
``GroupNormalized()`` advantages and
``ClippedSurrogate()``, except what the arm changes. Held-out accuracy is greedy pass@1 on the 64
test problems with 24 new tokens (the demo's ``eval_max_new_tokens``), before training (the base
model) and after the step budget.

Seeds: ``--seeds`` are training seeds (``GRPOConfig.seed``: prompt order, sampling, LoRA init;
the curriculum's seed). The split stays at the demo's seed 0 (``task_seed``), so every arm and
seed starts from the same base accuracy; the parent checks that. Arms that do not change what is
sampled first (all but ``curriculum``, whose prompt order is its own) sample the same first batch
under one seed, so their first-step rewards must agree; the parent warns when they do not. Each
worker records a digest of the ``grpo_engine`` sources it imported, and the parent reports a problem
when the workers' digests differ (the code was edited during the run: run on a copy of the tree).

Metrics per step, every arm: mean reward, ``entropy/token_mean`` (the trainer's token entropy over
the rows it trained; ``null`` for a step that trained no row), the mean normalised semantic
entropy of the step's groups and the fraction of collapsed groups (SE_norm <= 0.1 with accuracy
< 1), the temperature in force, the step's wall time. Every arm gets the same semantic-entropy
estimator so that it can be logged; ``GroupNormalized`` ignores it, so in the arms that do not use
it, it only observes (its cost, a few ms per step, is reported as ``se_s``).

Budget: ``--steps`` optimizer steps (not wall time: the machine may be shared, so a wall-clock
budget would be unfair between arms); wall and training time are recorded too. Arms run in a
rotated order per seed (seed k starts at arm k mod #arms) so that slow drifts of a shared
machine do not always hit the same arm.

Output in ``--out``: ``ablation.json`` (everything: settings, hardware, versions, every run with its
per-step metrics, the summary, checks; rewritten after each worker), ``reward_curves.png``, one
``<arm>-seed<k>.json`` and ``.log`` per worker; the last stdout line is one JSON object
``{arm: {"before", "after_mean", "after_std", "after_per_seed", "step_s"}}`` (``step_s``: the
median over every step of every seed of the arm; ``after_std``: sample standard deviation over
seeds, null with one seed).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness as harness

from grpo_engine.demo import DemoSettings

_DEMO = DemoSettings()
TOP_ENTROPY_QUANTILE = 0.2
# the trainer's per-step metrics kept as curves (None where a step did not log one)
CURVES = {"reward": "reward/mean", "token_entropy": "entropy/token_mean", "temperature": "temperature",
          "high_entropy_fraction": "high_entropy_fraction", "zero_std_fraction": "zero_std_fraction",
          "completion_length": "completion_length/mean"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one worker runs; the defaults are the demo's recipe."""

    model: str
    arm: str = "baseline"
    seed: int = 0  # training seed: GRPOConfig.seed and the curriculum's seed
    steps: int = 30
    task_seed: int = 0  # the split: the demo's, fixed so every arm starts at the same accuracy
    num_train: int = _DEMO.num_train
    num_test: int = _DEMO.num_test
    prompts_per_step: int = 4  # the demo's batch shape when docs/entropy.md was measured (it is 8 x 4 now)
    group_size: int = 8
    max_completion_tokens: int = _DEMO.max_completion_tokens
    eval_max_new_tokens: int = _DEMO.eval_max_new_tokens
    temperature: float = _DEMO.temperature
    learning_rate: float = _DEMO.learning_rate
    lora_r: int = _DEMO.lora_r
    micro_batch_size: int = _DEMO.micro_batch_size
    instruction: str = _DEMO.instruction
    threads: int = 1  # torch intra-op threads in the worker


# -- the arms: the trainer keyword arguments that turn one entropy use on ---------------------------


def _baseline(spec: Spec, train: Sequence) -> dict[str, Any]:
    return {}


def _entropy_scaled(spec: Spec, train: Sequence) -> dict[str, Any]:
    from grpo_engine.advantages import EntropyScaled

    return {"advantage": EntropyScaled()}


def _top_entropy_tokens(spec: Spec, train: Sequence) -> dict[str, Any]:
    from grpo_engine.losses import ClippedSurrogate

    return {"loss": ClippedSurrogate(top_entropy_quantile=TOP_ENTROPY_QUANTILE)}


def _adaptive_temperature(spec: Spec, train: Sequence) -> dict[str, Any]:
    from grpo_engine.entropy import AdaptiveTemperature

    return {"callbacks": [AdaptiveTemperature(initial=spec.temperature)]}


def _curriculum(spec: Spec, train: Sequence) -> dict[str, Any]:
    from grpo_engine.data import InformativeCurriculum

    return {"prompts": InformativeCurriculum(train, batch_size=spec.prompts_per_step, seed=spec.seed)}


ARMS: dict[str, Callable[[Spec, Sequence], dict[str, Any]]] = {
    "baseline": _baseline, "entropy_scaled": _entropy_scaled, "top_entropy_tokens": _top_entropy_tokens,
    "adaptive_temperature": _adaptive_temperature, "curriculum": _curriculum,
}


class ObservedEntropy:
    """An ``EntropyEstimator`` that delegates and remembers what it computed, and how long it took.

    Every arm's trainer gets one around ``SemanticEntropy(normalize=True)``, so that the semantic
    entropy and the collapsed-group fraction are logged for every arm; the worker reads and resets
    it after each step (:meth:`take`).
    """

    def __init__(self, estimator: Any) -> None:
        self.estimator = estimator
        self.seconds, self.calls = 0.0, 0
        self.last: tuple[Any, Any] | None = None  # (SE [B], accuracy [B]) of the last call

    @property
    def requires(self) -> Any:
        return self.estimator.requires

    def __call__(self, batch, rewards):
        start = time.perf_counter()
        out = self.estimator(batch, rewards)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.last = (out, rewards.total.float().mean(dim=1))  # one reward of weight 1: total = accuracy
        return out

    def take(self) -> dict[str, float | None]:
        """This step's mean SE, collapsed fraction, seconds and calls; then resets the counters."""
        from grpo_engine.entropy import collapsed_fraction

        se = collapsed = None
        if self.last is not None:
            entropy, accuracy = self.last
            se, collapsed = float(entropy.mean()), float(collapsed_fraction(entropy, accuracy))
        out = {"semantic_entropy": se, "collapsed_fraction": collapsed, "se_s": self.seconds,
               "se_calls": self.calls}
        self.seconds, self.calls, self.last = 0.0, 0, None
        return out


def build_trainer(spec: Spec, model, tokenizer, train: Sequence, template, reward, workdir: str):
    """The demo's trainer for ``spec`` (seed ``spec.seed``), with the arm's component installed."""
    from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
    from grpo_engine.entropy import SemanticEntropy

    config = GRPOConfig(
        prompts_per_step=spec.prompts_per_step, group_size=spec.group_size,
        max_completion_tokens=spec.max_completion_tokens, max_prompt_tokens=128, max_steps=spec.steps,
        temperature=spec.temperature, learning_rate=spec.learning_rate, seed=spec.seed, output_dir=workdir,
        progress_bar=False,
    )
    memory = MemoryPlan(lora=LoRA(r=spec.lora_r, alpha=2 * spec.lora_r),
                        micro_batch_size=spec.micro_batch_size)
    arm = {"prompts": train, **ARMS[spec.arm](spec, train)}
    return GRPOTrainer(model, [reward], config=config, memory=memory, tokenizer=tokenizer, template=template,
                       entropy=ObservedEntropy(SemanticEntropy(normalize=True)), **arm)


def source_hash(root: Path = harness.ROOT) -> str:
    """A digest of the ``grpo_engine`` sources, to catch workers that ran different code."""
    digest = hashlib.sha256()
    for path in sorted((root / "grpo_engine").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def run_arm(spec: Spec) -> dict:
    """Loads the base model, measures it, trains ``spec.steps`` steps, measures again."""
    import torch

    from grpo_engine.data import ChatTemplate, arithmetic_task
    from grpo_engine.eval import greedy_accuracy
    from grpo_engine.models import load_model
    from grpo_engine.rewards import MathAccuracy

    wall, code = time.perf_counter(), source_hash()  # the code this process has just imported
    torch.set_num_threads(spec.threads)
    model, tokenizer = load_model(spec.model)
    model.eval()
    train, test = arithmetic_task(spec.num_train, spec.num_test, seed=spec.task_seed)
    template, reward = ChatTemplate(instruction=spec.instruction), MathAccuracy()

    def accuracy(policy) -> float:  # the demo's held-out measure
        return greedy_accuracy(policy, tokenizer, test, reward, template=template,
                               max_new_tokens=spec.eval_max_new_tokens, batch_size=len(test)).accuracy

    before = accuracy(model)
    print(f"[{spec.arm} seed {spec.seed}] before {before:.4f}", file=sys.stderr, flush=True)
    steps: list[dict] = []
    history: list[dict] = []
    with tempfile.TemporaryDirectory(prefix=f"ablation-{spec.arm}-") as workdir:
        trainer = build_trainer(spec, model, tokenizer, train, template, reward, workdir)
        for _ in range(spec.steps):
            start = time.perf_counter()
            metrics = trainer.step()
            seconds = time.perf_counter() - start
            row = {name: metrics.get(key) for name, key in CURVES.items()}
            if row["token_entropy"] == 0.0:  # the trainer logs 0 when it trained no row: not a measurement
                row["token_entropy"] = None
            row.update(trainer.entropy.take(), step_s=seconds)
            steps.append(row)
            history.append(metrics)
            print(f"[{spec.arm} seed {spec.seed}] step {len(steps)}: {json.dumps(row)}", file=sys.stderr,
                  flush=True)
        after = accuracy(trainer.model)
    step_s = [r["step_s"] for r in steps]
    curves = {key: [r[key] for r in steps] for key in steps[0]} if steps else {}
    print(f"[{spec.arm} seed {spec.seed}] after {after:.4f}", file=sys.stderr, flush=True)
    return {"arm": spec.arm, "seed": spec.seed, "before": before, "after": after, "steps": len(steps),
            "step_s_median": harness.median(step_s), "train_s": sum(step_s),
            "wall_s": time.perf_counter() - wall, "curves": curves, "history": history,
            "spec": dataclasses.asdict(spec), "code": code}


# -- the parent: run the workers, aggregate, check, plot ------------------------------------------


def _run_worker(spec: Spec, out: Path) -> tuple[dict | None, str | None]:
    """Runs one (arm, seed) worker; its log and result go to ``out/<arm>-seed<k>.log`` / ``.json``."""
    name = f"{spec.arm}-seed{spec.seed}"
    args = [str(Path(__file__).resolve()), "--worker", json.dumps(dataclasses.asdict(spec))]
    env = harness.worker_env(OMP_NUM_THREADS=str(spec.threads), MKL_NUM_THREADS=str(spec.threads))
    timeout = 1200 + 120 * spec.steps  # loading, two evaluations and slow steps on a shared machine
    result, error = harness.run_worker(name, args, timeout, env, out / f"{name}.log")
    if result is not None:
        harness.write_report(out / f"{name}.json", result)
    return result, error


def summarize(runs: Sequence[dict]) -> dict[str, dict]:
    """Per arm: before, after (mean, sample std over seeds, per seed), median step time, steps."""
    out: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        after = [r["after"] for r in rs]
        out[arm] = {
            "before": harness.mean(r["before"] for r in rs),
            "after_mean": harness.mean(after),
            "after_std": harness.sd(after),
            "after_per_seed": after,
            "step_s": harness.median(s for r in rs for s in r["curves"]["step_s"]),
            "seeds": [r["seed"] for r in rs],
            "steps_per_seed": [r["steps"] for r in rs],
            "train_s_per_seed": [r["train_s"] for r in rs],
            "wall_s_per_seed": [r["wall_s"] for r in rs],
        }
    return out


def checks(runs: Sequence[dict], steps: int) -> tuple[list[str], list[str]]:
    """(problems, warnings): problems break the comparison, warnings qualify it."""
    problems, warnings = [], []
    codes = {r.get("code") for r in runs}
    if len(codes) > 1:
        problems.append(f"the workers imported different grpo_engine sources {sorted(map(str, codes))}: "
                        "the code changed during the run; run again on a tree nobody edits (e.g. a copy)")
    befores = {r["before"] for r in runs}
    if len(befores) > 1:
        problems.append(f"the base model scored differently across workers: {sorted(befores)}")
    for r in runs:
        if r["steps"] != steps:
            problems.append(f"{r['arm']} seed {r['seed']}: {r['steps']} steps, not {steps}")
    for seed in sorted({r["seed"] for r in runs}):
        first = {r["arm"]: r["curves"]["reward"][0] for r in runs
                 if r["seed"] == seed and r["arm"] != "curriculum" and r["curves"].get("reward")}
        if len(set(first.values())) > 1:
            warnings.append(f"seed {seed}: first-step rewards differ between arms that sample the same first "
                            f"batch: {first} (sampling is not reproducible across processes)")
    return problems, warnings


def _smooth(values: Sequence[float], window: int = 5) -> list[float]:
    return [harness.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def _seed_mean(runs: Sequence[dict], key: str) -> list[float | None]:
    """Per step, the mean over seeds of a curve (None where no seed has a value)."""
    curves = [r["curves"][key] for r in runs]
    out = []
    for i in range(max(map(len, curves), default=0)):
        out.append(harness.mean(c[i] for c in curves if i < len(c)))
    return out


def plot(runs: Sequence[dict], summary: dict[str, dict], path: Path, *, title: str) -> None:
    """Mean reward per step (5-step moving average, mean over seeds) and semantic entropy, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm, s in summary.items():
        rs = [r for r in runs if r["arm"] == arm]
        reward = _seed_mean(rs, "reward")
        label = f"{arm}: {s['before']:.0%} -> {s['after_mean']:.0%}"
        line, = left.plot(range(1, len(reward) + 1), _smooth(reward), label=label)
        se = _seed_mean(rs, "semantic_entropy")
        right.plot(range(1, len(se) + 1), _smooth([v if v is not None else float("nan") for v in se]),
                   color=line.get_color(), label=arm)
    left.set_xlabel("optimizer step")
    left.set_ylabel("mean reward (5-step moving average)")
    left.legend(loc="upper left", fontsize=7, title="held-out greedy accuracy", title_fontsize=7)
    right.set_xlabel("optimizer step")
    right.set_ylabel("semantic entropy / ln G (5-step moving average)")
    right.set_ylim(0, 1.02)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def ablate(base: Spec, arms: Sequence[str], seeds: Sequence[int], out: Path) -> dict:
    """Runs every (seed, arm) worker, seed k's arms rotated to start at arm k; returns the full report
    (``out/ablation.json``, rewritten after each worker)."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs, errors = [], []

    def report() -> dict:
        ordered = sorted(runs, key=lambda r: (list(arms).index(r["arm"]), r["seed"]))
        problems, warnings = checks(ordered, base.steps)
        return {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                "date": time.strftime("%Y-%m-%d"),
                "hardware": harness.hardware("cpu") + f", {base.threads} torch thread(s) per worker",
                "versions": harness.versions(), "commit": harness.git_commit(),
                "code": sorted({str(r.get("code")) for r in ordered}), "spec": dataclasses.asdict(base),
                "arms": list(arms), "seeds": list(seeds), "summary": summarize(ordered), "problems": problems,
                "warnings": warnings, "errors": list(errors), "wall_s": time.perf_counter() - start,
                "runs": ordered}

    for k, arm in harness.schedule(arms, range(len(seeds)), rotate=True):
        seed = seeds[k]
        harness.say("ablation", f"seed {seed}: {arm} ({base.steps} steps)")
        result, error = _run_worker(dataclasses.replace(base, arm=arm, seed=seed), out)
        if error:
            errors.append(error)
            harness.say("ablation", error)
        else:
            runs.append(result)
            harness.say("ablation", f"{arm} seed {seed}: {result['before']:.4f} -> {result['after']:.4f}, "
                                    f"{result['step_s_median']:.2f} s/step, wall {result['wall_s']:.0f} s")
        harness.write_report(out / "ablation.json", report())
    final = report()
    if final["runs"]:
        plot(final["runs"], final["summary"], out / "reward_curves.png",
             title=f"{Path(base.model).name}, demo task, {base.steps} steps, seeds {list(seeds)}, "
                   f"B={base.prompts_per_step} G={base.group_size}")
    harness.write_report(out / "ablation.json", final)
    return final


def _table(report: dict) -> str:
    lines = [f"{'arm':22}{'before':>8}{'after mean':>12}{'± std':>8}  {'per seed':22}{'s/step':>8}"]
    for arm, s in report["summary"].items():
        std = f"{s['after_std']:.3f}" if s["after_std"] is not None else "-"
        per_seed = " ".join(f"{a:.3f}" for a in s["after_per_seed"])
        lines.append(f"{arm:22}{s['before']:8.3f}{s['after_mean']:12.3f}{std:>8}  "
                     f"{per_seed:22}{s['step_s']:8.2f}")
    lines += [f"PROBLEM: {x}" for x in report["problems"]] + [f"WARNING: {x}" for x in report["warnings"]]
    lines += [f"ERROR: {x}" for x in report["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="default: all")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds (default 0)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per arm and seed (default 30)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    parser.add_argument("--model", help="a transformers folder (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, help="output folder (default runs/entropy_ablation/<timestamp>)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        harness.emit(run_arm(Spec(**json.loads(args.worker))))
        return 0
    if args.steps < 1 or args.threads < 1 or len(set(args.seeds)) != len(args.seeds):
        parser.error("need --steps >= 1, --threads >= 1 and distinct --seeds")
    if args.model is None:
        from grpo_engine.demo import smollm2_folder

        args.model = str(smollm2_folder())
    base = Spec(model=str(args.model), steps=args.steps, threads=args.threads)
    out = args.out or harness.ROOT / "runs" / "entropy_ablation" / time.strftime("%Y%m%d-%H%M%S")
    report = ablate(base, list(dict.fromkeys(args.arms)), args.seeds, out)
    print(_table(report), flush=True)
    print(f"report and plot: {out}", flush=True)
    keys = ("before", "after_mean", "after_std", "after_per_seed", "step_s")
    print(json.dumps({arm: {k: s[k] for k in keys} for arm, s in report["summary"].items()}), flush=True)
    return 1 if report["problems"] or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
