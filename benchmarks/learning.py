"""Learning per wall-clock second: grpo_engine against TRL on the same task, model and budget.

Both engines train the same model with LoRA on the demo's task for the same training wall time,
each (engine, seed) in a fresh process, alternating the order (seed 0: ours then trl, seed 1: trl
then ours, ...). The parent prints a summary, writes ``learning.png`` (held-out accuracy against
training wall time) and ``report.json`` to ``--out``, and prints one JSON object as its last line:
``{"task", "budget_s", "ours": {"before", "after", "steps", ..., "settings"}, "trl": {...},
"delta_after_pts", ...}``; each engine's ``settings`` (also a "used" line of the summary) is what
it trained with. ``report.json`` (rewritten after each worker, so a crash keeps what finished) also holds
each run's mean reward, mean completion length and truncated fraction per step (the fraction of the
step's completions cut at the token limit) and the trained policy's greedy completions of the
curve's prompts (``completions_after``).

    python benchmarks/learning.py                       # identical settings, 480 s each, SmolLM2-135M
    python benchmarks/learning.py --mode defaults --seeds 2 --budget-s 300   # recommended settings
    python benchmarks/learning.py --mode defaults --first-seed 2 --seeds 1   # seed 2 alone, later
    python benchmarks/learning.py --steps 88 --num-test 256   # equal work: 88 steps each, no time budget
    python benchmarks/learning.py --task rg:gcd --task-config '{"max_value": 100}'   # a reasoning-gym family

``--task rg:FAMILY`` (with ``--task-config``, the family's config fields as JSON) trains and evaluates
on a reasoning-gym family as the demo's ``--task`` does (``grpo_engine.demo.demo_task``): the bare
question (no system prompt) plus " Reply with only the final answer.", train and test from
``reasoning_gym_task(FAMILY, num_train, num_test, seed=task_seed, config=...)`` (disjoint by question),
scored by the family's own ``score_answer`` on the final answer (``ReasoningGymScore(extract="final")``;
correct: a score of 1; TRL's reward function scores each completion against its own prompt's entry).

The task (exactly the demo's, ``grpo_engine.demo``): ``arithmetic_task(num_train, num_test,
seed=task_seed)`` (two-digit ``a + b`` / ``a - b``, train and test drawn without replacement from
one pool, so no problem is in both; the workers check it), rendered by the tokenizer's chat
template over one user turn, the question plus " Reply with only the final number." (our
``ChatTemplate``; TRL gets the same messages as a conversational dataset and renders them with
the same template; both workers report the token ids of the first training prompt and the parent
fails when they differ). Reward: ``MathAccuracy`` (1 iff the last number equals the target), in
TRL through a reward function calling it. The task is honest when the base model starts between
10% and 50% greedy accuracy; outside that range the parent warns.

Evaluation, the same function for both (``grpo_engine.eval.greedy_accuracy``, greedy decoding,
``max_new_tokens`` = the completion limit, ``MathAccuracy`` >= 1 is correct, one generate call
per evaluation): ``before`` and ``after`` on the whole test split, the base model before the
trainer is built and the trained (adapter-wrapped) policy after the budget; the curve on the first
``--eval-subset`` test prompts, at training time 0, every ``--eval-every-s`` seconds of training
time and at the end. Evaluation runs with the training clock stopped.

``--steps N`` compares equal work instead of equal time: each engine trains exactly N optimizer
steps, whatever they take, and the curve has a point every ``--eval-every-steps`` steps; it shows
whether the two learn alike per step over a whole run (if they do, the time-budgeted comparison
differs only by each engine's step time).

Training wall time: ours, the sum of ``trainer.step()`` durations; TRL, the time between
``on_train_begin`` / consecutive ``on_step_end`` callbacks minus the evaluations inside them.
Loading the model and building the trainer are not counted. Both stop at the first step end at or
past ``--budget-s`` (so both overshoot by up to one step). ``steps`` are optimizer steps; a step
is one generation of B prompts x G completions and one optimizer update on them, for both.

``--mode identical`` (isolates speed and correctness): both engines run
B = ``--prompts-per-step`` (4), G = ``--group-size`` (8), ``--max-completion-tokens`` (24),
LoRA r 16, alpha 32, dropout 0 on every linear layer but the lm_head, lr 1e-4 constant with no
warm-up, AdamW (torch, betas 0.9 / 0.99, eps 1e-8, no weight decay), gradient clipping at 1.0,
temperature 1.0 with no top-p / top-k, one update per batch (mu = 1), PPO clip 0.2, no KL, group
z-score advantages (eps 1e-4, TRL's), token-mean loss aggregation over the step (ours
``ClippedSurrogate(aggregation="token")`` = TRL's default ``loss_type="dapo"``), float32 without
autocast, no gradient checkpointing, the same micro-batch (``--micro-batch-size``, default the
demo's 16, reduced to gcd with B*G). TRL mapping: ``num_generations=G``,
``per_device_train_batch_size=m`` (completions per forward/backward),
``gradient_accumulation_steps=B*G/m`` and ``steps_per_generation`` left to default to it, so one
optimizer step consumes exactly the B*G completions of one generation (``benchmarks/perf.py``'s
mapping). The workers read back what each engine holds and the parent fails when it differs.

``--mode defaults``: each engine's recommended settings for this hardware (what its users would
pick on the machine the benchmark runs on, a 2-core CPU by default; each keeps its own learning
rate, batch shape, loss and other recipe choices). Both train with the completion limit the task
needs, the demo's ``DemoSettings().max_completion_tokens`` (16 new tokens), while the evaluation
keeps ``--max-completion-tokens`` for both; on the CPU both train in float32 without autocast and
without gradient checkpointing (a 135M model with LoRA is not short of memory).

- ours: ``DemoSettings()`` (its batch shape ``prompts_per_step`` x ``group_size``, lr 3e-4 with
  its ``lr_schedule``, temperature 1.0, LoRA r 16 / alpha 32, micro-batch 16, 128 prompt tokens,
  ``max_completion_tokens``; ``--prompts-per-step`` / ``--group-size`` then apply to TRL only;
  ``max_train_seconds`` is the budget, so a ``linear`` / ``cosine`` schedule decays over it: the
  trainer's clock, the time spent in ``step()``, is what this benchmark counts) and ``GRPOConfig``
  / component defaults for everything else (AdamW betas 0.9 / 0.99, clipping 1.0, the recipe's
  advantage and loss (``grpo_engine.demo.recipe_components``: Dr. GRPO's group mean without the
  std, tokens summed over sequences x 16), clip 0.2, no KL, float32, the prompt shared across its
  group in sampling and in the training pass).
- TRL: ``GRPOConfig()`` defaults except what the task fixes (``num_generations=G``, B*G
  completions per generation and per optimizer step, ``max_completion_length`` = the demo's 16,
  the same LoRA ``peft_config``), lr 1e-4 (the rate at which TRL learned this task in our earlier
  runs; TRL's default 1e-6 is meant for full fine-tuning) and, on the CPU, ``bf16=False``, ``fp16=False`` and
  ``gradient_checkpointing=False``: TRL's defaults switch bf16 autocast and gradient checkpointing
  on, choices for a GPU (with ``--device cuda`` they stay on). So: temperature 1.0,
  ``loss_type="dapo"``, linear lr decay over ``max_steps`` (set to 10**6, so the decay within a run
  is < 0.01%), AdamW betas 0.9 / 0.999, ``per_device_train_batch_size`` 8 (its default, reduced to
  gcd with B*G).

Settings that are not about learning, the same in both modes: TRL ``report_to="none"``,
``save_strategy="no"``, ``logging_steps=1`` (to record its mean reward per step),
``disable_tqdm``, ``use_cpu`` on the CPU, ``log_completions=False``, ``max_steps=10**6`` (the
budget callback stops it); ours ``max_steps=10**9`` (the loop stops it), no progress bar, nothing
saved. Prompt order differs (each engine shuffles with its own seeded sampler).

Not the same by construction, and reported as such: how each engine generates (ours prefills a
prompt once per group; TRL generates the B*G rows through ``generate``), and the stop tokens
(each engine's own rule, reported as ``eos_ids``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _harness as harness
import _trl as trl

INSTRUCTION = " Reply with only the final number."  # the demo's (grpo_engine.demo.DemoSettings)
HONEST_RANGE = (0.10, 0.50)  # greedy accuracy of the base model that keeps the task honest
ENGINES = ("ours", "trl")
MODES = {"identical": "identical settings",
         "defaults": "each engine's recommended settings for this hardware"}
IDENTICAL = {"learning_rate": 1e-4, "temperature": 1.0, "aggregation": "token", "lora_r": 16,
             "lora_alpha": 32.0, "advantage_eps": 1e-4, "adam_betas": (0.9, 0.99)}
TRL_DEFAULTS_LR = 1e-4  # TRL's LoRA rate on this task in our runs (its default, 1e-6, is for full FT)
# what a TRL user picks on a CPU: TRL's defaults turn on bf16 autocast and gradient checkpointing, both
# choices for a GPU (and a 135M model with LoRA is not short of memory)
TRL_ON_CPU = {"bf16": False, "fp16": False, "gradient_checkpointing": False}
STEP_LIMIT_S = 120.0  # with --steps, a worker taking longer than this per step is killed


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one worker runs; everything but ``engine``-specific choices is the same for both."""

    model: str
    mode: str = "identical"  # "identical" or "defaults"
    task: str = "arithmetic"  # the demo's task, or "rg:FAMILY" (a reasoning-gym family)
    task_config: dict | None = None  # the family's config fields
    seed: int = 0
    budget_s: float = 480.0
    steps: int | None = None  # equal work: both stop after this many optimizer steps (no time budget)
    eval_every_steps: int = 10  # with ``steps``: a curve point every this many steps
    task_seed: int = 0
    num_train: int = 1000
    num_test: int = 64
    eval_subset: int = 32
    eval_every_s: float = 60.0
    prompts_per_step: int = 4  # B
    group_size: int = 8  # G
    max_completion_tokens: int = 24
    micro_batch_size: int | None = None  # None: the demo's (identical), each engine's own (defaults)
    device: str = "cpu"

    @property
    def completions(self) -> int:
        return self.prompts_per_step * self.group_size


# -- the training clock ---------------------------------------------------------------------------


class TrainingClock:
    """Training wall time with evaluation excluded, and the accuracy curve over it.

    ``step_done(seconds)`` adds one step; once the training time passes the next multiple of
    ``eval_every_s`` (and the budget is not spent) it evaluates, with the clock stopped. With
    ``max_steps`` (equal work) the run is spent after that many steps instead of at the budget, and
    the curve has a point every ``eval_every_steps`` steps instead of every ``eval_every_s`` seconds.
    """

    def __init__(self, budget_s: float, eval_every_s: float, evaluate: Callable[[], float],
                 max_steps: int | None = None, eval_every_steps: int = 0) -> None:
        self.budget_s = budget_s
        self.max_steps = max_steps
        self.eval_every_steps = eval_every_steps if max_steps is not None else 0
        self.eval_every_s = eval_every_s if eval_every_s > 0 and max_steps is None else math.inf
        self.evaluate = evaluate
        self.train_s = 0.0
        self.eval_s = 0.0
        self.step_s: list[float] = []
        self.curve: list[dict[str, float]] = []
        self._next_eval = self.eval_every_s

    @property
    def steps(self) -> int:
        return len(self.step_s)

    @property
    def spent(self) -> bool:
        if self.max_steps is not None:
            return self.steps >= self.max_steps
        return self.train_s >= self.budget_s

    def checkpoint(self) -> None:
        start = time.perf_counter()
        accuracy = self.evaluate()
        self.eval_s += time.perf_counter() - start
        self.curve.append({"train_s": self.train_s, "step": self.steps, "accuracy": accuracy})
        print(f"[{self.steps} steps, {self.train_s:.1f} s] subset accuracy {accuracy:.3f}", file=sys.stderr,
              flush=True)

    def step_done(self, seconds: float) -> None:
        self.train_s += seconds
        self.step_s.append(seconds)
        if self.spent:
            return
        if self.eval_every_steps and self.steps % self.eval_every_steps == 0:
            self.checkpoint()
        elif self.train_s >= self._next_eval:
            self.checkpoint()
            self._next_eval = (math.floor(self.train_s / self.eval_every_s) + 1) * self.eval_every_s

    def summary(self) -> dict:
        return {"steps": self.steps, "train_s": self.train_s, "eval_s": self.eval_s,
                "step_s_mean": self.train_s / self.steps if self.steps else None,
                "step_s_median": harness.median(self.step_s),
                "step_s": self.step_s, "curve": self.curve}


# -- what both workers share ----------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """The model, tokenizer, task and evaluation of one worker."""

    model: object
    tokenizer: object
    train: list
    test: list
    template: object
    reward: object
    spec: Spec
    last_completions: list[str] = dataclasses.field(default_factory=list)

    def accuracy(self, policy, prompts) -> float:
        """Greedy accuracy on ``prompts``; their completions are kept in ``last_completions``."""
        from grpo_engine.eval import greedy_accuracy

        result = greedy_accuracy(policy, self.tokenizer, prompts, self.reward, template=self.template,
                                 max_new_tokens=self.spec.max_completion_tokens, batch_size=len(prompts))
        self.last_completions = list(result.completions)
        return result.accuracy

    def clock(self, policy: Callable[[], object]) -> TrainingClock:
        subset = self.test[:self.spec.eval_subset]
        return TrainingClock(self.spec.budget_s, self.spec.eval_every_s,
                             lambda: self.accuracy(policy(), subset), max_steps=self.spec.steps,
                             eval_every_steps=self.spec.eval_every_steps)


def _setup(spec: Spec) -> Setup:
    import torch

    from grpo_engine.data import ChatTemplate, arithmetic_task
    from grpo_engine.models import load_model
    from grpo_engine.rewards import MathAccuracy

    if spec.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda but torch {torch.__version__} sees no GPU")
    model, tokenizer = load_model(spec.model)
    model = model.to(spec.device).eval()
    if spec.task == "arithmetic":
        train, test = arithmetic_task(spec.num_train, spec.num_test, seed=spec.task_seed)
        template, reward = ChatTemplate(instruction=INSTRUCTION), MathAccuracy()
    else:  # "rg:FAMILY": the demo's reasoning-gym task, template and scorer, the bare question
        from grpo_engine.demo import DemoSettings, demo_reward, demo_task, demo_template

        demo = DemoSettings(task=spec.task.removeprefix("rg:"), task_config=spec.task_config,
                            num_train=spec.num_train, num_test=spec.num_test, seed=spec.task_seed)
        (train, test), template, reward = demo_task(demo), demo_template(demo), demo_reward(demo)
    shared = {p.question for p in train} & {p.question for p in test}
    if shared:
        raise SystemExit(f"train and test share {len(shared)} prompts, e.g. {sorted(shared)[0]!r}")
    return Setup(model, tokenizer, train, test, template, reward, spec)


def trl_rows(s: Setup) -> list[dict]:
    """TRL's conversational dataset: each training prompt's messages and its index in ``s.train``."""
    return [{"prompt": s.template.messages(p), "index": i} for i, p in enumerate(s.train)]


def trl_reward(s: Setup) -> Callable[..., list[float]]:
    """TRL's reward function: ``s.reward`` of each completion against its own prompt (by the row's
    ``index``: a reasoning-gym entry is scored by its own data, not only its answer text)."""

    def accuracy(completions, index, **kwargs) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return s.reward([s.train[i] for i in index], texts).tolist()

    return accuracy


def _micro(requested: int, completions: int) -> int:
    """A micro-batch that divides B*G (TRL needs it; ours then does the same work per pass)."""
    return math.gcd(requested, completions)


_advantage = harness.advantage_text  # the normalisation in words, as both engines' settings give it


# -- the two workers ------------------------------------------------------------------------------


def run_ours(spec: Spec, workdir: str) -> dict:
    import torch

    from grpo_engine import ClippedSurrogate, GroupNormalized, GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
    from grpo_engine.demo import DemoSettings, recipe_components

    demo = DemoSettings()
    s = _setup(spec)
    before = s.accuracy(s.model, s.test)
    if spec.mode == "identical":
        lr, temperature, aggregation = (IDENTICAL["learning_rate"], IDENTICAL["temperature"],
                                        IDENTICAL["aggregation"])
        schedule = "constant"
        r, alpha, eps = IDENTICAL["lora_r"], IDENTICAL["lora_alpha"], IDENTICAL["advantage_eps"]
        micro = _micro(spec.micro_batch_size or demo.micro_batch_size, spec.completions)
        advantage, loss = GroupNormalized(eps=eps), ClippedSurrogate(aggregation=aggregation)
        train_tokens = spec.max_completion_tokens
        prompts, group = spec.prompts_per_step, spec.group_size
        merge = False
    else:
        lr, temperature, r, alpha = demo.learning_rate, demo.temperature, demo.lora_r, 2.0 * demo.lora_r
        # a decay follows the trainer's clock, step time as the benchmark counts it
        schedule = demo.lr_schedule
        micro = spec.micro_batch_size or demo.micro_batch_size
        parts = recipe_components(demo)
        advantage, loss = parts["advantage"], parts["loss"]
        train_tokens = demo.max_completion_tokens  # our recipe's training cap; evaluation keeps the task's
        prompts, group = demo.prompts_per_step, demo.group_size  # our recipe's batch shape
        merge = demo.merge_lora_for_sampling
    torch.manual_seed(spec.seed)
    config = GRPOConfig(
        prompts_per_step=prompts, group_size=group,
        max_completion_tokens=train_tokens, max_prompt_tokens=128, max_steps=10**9,
        max_train_seconds=spec.budget_s if spec.steps is None else None,
        temperature=temperature, learning_rate=lr, lr_schedule=schedule, seed=spec.seed, output_dir=workdir,
        progress_bar=False,
    )
    memory = MemoryPlan(lora=LoRA(r=r, alpha=alpha, dropout=0.0, target_modules="all-linear"),
                        micro_batch_size=micro, merge_lora_for_sampling=merge)
    trainer = GRPOTrainer(s.model, [s.reward], s.train, config, memory, tokenizer=s.tokenizer,
                          template=s.template, advantage=advantage, loss=loss)
    clock = s.clock(lambda: trainer.model)
    clock.checkpoint()
    rewards, lengths, truncated = [], [], []
    while not clock.spent:
        start = time.perf_counter()
        metrics = trainer.step()
        clock.step_done(time.perf_counter() - start)
        rewards.append(metrics["reward/mean"])
        lengths.append(metrics["completion_length/mean"])
        truncated.append(metrics["truncated_fraction"])
    clock.checkpoint()
    after = s.accuracy(trainer.model, s.test)
    answers = s.last_completions[:spec.eval_subset]  # the trained policy's greedy completions
    ids, mask = trainer.sampler.encode_prompts(s.train[:1])
    settings = trl.ours_settings(trainer)
    return {"before": before, "after": after, **clock.summary(), "reward_mean_per_step": rewards,
            "completion_length_per_step": lengths, "truncated_fraction_per_step": truncated,
            "completions_after": answers, "settings": settings, "prompt_ids": ids[0][mask[0]].tolist()}


def run_trl(spec: Spec, workdir: str) -> dict:
    import torch
    from datasets import Dataset

    from grpo_engine.demo import DemoSettings

    s = _setup(spec)
    before = s.accuracy(s.model, s.test)
    n = spec.completions
    if spec.mode == "identical":
        micro = _micro(spec.micro_batch_size or DemoSettings().micro_batch_size, n)
        lora = (IDENTICAL["lora_r"], IDENTICAL["lora_alpha"])
        own = dict(trl.matched(aggregation=IDENTICAL["aggregation"], learning_rate=IDENTICAL["learning_rate"],
                               temperature=IDENTICAL["temperature"], adam_betas=IDENTICAL["adam_betas"]),
                   bf16=False, fp16=False, gradient_checkpointing=False)
        train_tokens = spec.max_completion_tokens
    else:  # TRL's defaults, but for what a user picks on this hardware and the task's completion limit
        from trl import GRPOConfig as TRLConfig

        default = next(f.default for f in dataclasses.fields(TRLConfig)
                       if f.name == "per_device_train_batch_size")
        micro = _micro(spec.micro_batch_size or default, n)
        lora = (IDENTICAL["lora_r"], IDENTICAL["lora_alpha"])
        own = dict(TRL_ON_CPU) if spec.device == "cpu" else {}  # on a GPU, TRL's own bf16 and checkpointing
        own["learning_rate"] = TRL_DEFAULTS_LR
        train_tokens = DemoSettings().max_completion_tokens  # ours trains at the same limit in this mode
    data = Dataset.from_list(trl_rows(s))
    accuracy = trl_reward(s)

    torch.manual_seed(spec.seed)
    trainer = trl.build(s.model, s.tokenizer, data, accuracy, workdir=workdir, group_size=spec.group_size,
                        completions=n, micro_batch_size=micro, max_completion_tokens=train_tokens,
                        max_steps=10**6, seed=spec.seed, device=spec.device, lora=lora, logging_steps=1,
                        **own)
    clock = s.clock(lambda: trainer.model)

    def step_done(seconds: float) -> bool:  # an evaluation it triggers is not training time
        clock.step_done(seconds)
        return clock.spent

    trainer.add_callback(trl.step_timer(step_done))
    clock.checkpoint()
    trainer.train()
    clock.checkpoint()
    after = s.accuracy(trainer.model, s.test)
    answers = s.last_completions[:spec.eval_subset]  # the trained policy's greedy completions
    try:  # TRL's own rendering of a prompt (a private method: None if it moves)
        prompt_ids = list(trainer._tokenize_prompts([s.template.messages(s.train[0])])[0][0])
    except Exception:
        prompt_ids = None
    logged = [h for h in trainer.state.log_history if "reward" in h]
    return {"before": before, "after": after, **clock.summary(),
            "reward_mean_per_step": [h["reward"] for h in logged],
            "completion_length_per_step": [h.get("completions/mean_length") for h in logged],
            "truncated_fraction_per_step": [h.get("completions/clipped_ratio") for h in logged],
            "completions_after": answers, "settings": trl.settings(trainer), "prompt_ids": prompt_ids}


def worker(engine: str, spec: Spec) -> dict:
    """Runs one engine in this process; returns its result (also what the parent reads)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"learning-{engine}-") as workdir:
        result = (run_ours if engine == "ours" else run_trl)(spec, workdir)
    return {"engine": engine, "seed": spec.seed, "mode": spec.mode, **result,
            "wall_s": time.perf_counter() - start}


# -- the parent: alternate, aggregate, plot -------------------------------------------------------


def _run_worker(engine: str, spec: Spec, out: Path) -> tuple[dict | None, str | None]:
    """Runs one (engine, seed) worker; its log and result go to ``out/<engine>-seed<k>.log`` / ``.json``."""
    name = f"{engine}-seed{spec.seed}"
    args = [str(Path(__file__).resolve()), "--worker", engine, "--spec", json.dumps(dataclasses.asdict(spec))]
    # the budget, overshoot, loading and evaluations; with equal steps, up to STEP_LIMIT_S a step
    timeout = (2 * spec.budget_s if spec.steps is None else STEP_LIMIT_S * spec.steps) + 1800
    result, error = harness.run_worker(name, args, timeout, harness.worker_env(), out / f"{name}.log")
    if result is not None:
        harness.write_report(out / f"{name}.json", result)
    return result, error


def _engine_summary(runs: list[dict]) -> dict | None:
    """One engine over its seeds: means (one seed: its values), and the settings it trained with."""
    if not runs:
        return None

    def mean(key: str):  # one seed: its own value (steps stay an int)
        values = [r[key] for r in runs if r[key] is not None]
        return values[0] if len(runs) == 1 and values else harness.mean(values)

    out = {"before": mean("before"), "after": mean("after"), "steps": mean("steps"),
           "step_s": mean("step_s_mean"), "train_s": mean("train_s")}
    if len(runs) > 1:
        out.update({"after_std": harness.sd(r["after"] for r in runs), "seeds": [r["seed"] for r in runs],
                    **{f"{k}_runs": [r[k] for r in runs] for k in ("before", "after", "steps")}})
    out["settings"] = runs[0]["settings"]  # what the engine held (the same for every seed)
    return out


def _precision(s: dict) -> str:
    """The weights' dtype, and the autocast dtype when it differs: ``"float32 + bf16 autocast"``."""
    short = {"bfloat16": "bf16", "float16": "fp16"}
    if s["compute_dtype"] == s["weights_dtype"]:
        return s["weights_dtype"]
    return f"{s['weights_dtype']} + {short.get(s['compute_dtype'], s['compute_dtype'])} autocast"


def _used(s: dict) -> str:
    """What an engine trained with, in one line of the table (the settings the defaults mode lets differ)."""
    checkpointing = "gradient checkpointing" if s["gradient_checkpointing"] else "no gradient checkpointing"
    return (f"{s['prompts_per_step']} prompts x {s['group_size']} completions, {s['max_completion_tokens']} "
            f"completion tokens, {_precision(s)}, {checkpointing}, "
            f"lr {s['learning_rate']:g} {s['lr_schedule']}, "
            f"{s['aggregation']} loss aggregation, advantage {s['advantage']}, "
            f"micro-batch {s['micro_batch_size']}")


def _checks(spec: Spec, runs: dict[str, list[dict]]) -> tuple[list[str], list[str]]:
    """(problems, warnings): problems make the comparison invalid, warnings qualify it."""
    problems, warnings = [], []
    for engine, rs in runs.items():
        for r in rs:
            if r["steps"] < 1:
                problems.append(f"{engine} seed {r['seed']}: no training step within {_budget(spec)}")
            if spec.steps is not None and r["steps"] != spec.steps:
                problems.append(f"{engine} seed {r['seed']}: {r['steps']} steps, not --steps {spec.steps}")
            if not HONEST_RANGE[0] <= r["before"] <= HONEST_RANGE[1]:
                warnings.append(f"{engine} seed {r['seed']}: base model greedy accuracy {r['before']:.3f} "
                                f"is outside {HONEST_RANGE}: the task is too hard or too easy for this model")
    for a, b in zip(runs["ours"], runs["trl"]):
        if a["before"] != b["before"]:
            problems.append(f"seed {a['seed']}: the base model scored {a['before']} for ours, "
                            f"{b['before']} for trl")
        if b["prompt_ids"] is not None and a["prompt_ids"] != b["prompt_ids"]:
            problems.append(f"seed {a['seed']}: the engines render the first training prompt "
                            "to different tokens")
        if spec.mode == "identical":
            for key in sorted(set(a["settings"]) | set(b["settings"])):
                if a["settings"].get(key) != b["settings"].get(key):
                    problems.append(f"setting {key}: ours {a['settings'].get(key)!r} "
                                    f"!= trl {b['settings'].get(key)!r}")
    return list(dict.fromkeys(problems)), list(dict.fromkeys(warnings))


def _budget(spec: Spec) -> str:
    """What bounds each engine's training: the time budget, or (equal work) the step count."""
    return f"{spec.budget_s:g} s" if spec.steps is None else f"{spec.steps} steps"


def _task_name(spec: Spec) -> str:
    if spec.task != "arithmetic":
        from grpo_engine.demo import DemoSettings

        config = f", config={json.dumps(spec.task_config)}" if spec.task_config else ""
        return (f"reasoning_gym_task({spec.task.removeprefix('rg:')!r}{config}, num_train={spec.num_train}, "
                f"num_test={spec.num_test}, seed={spec.task_seed}, system_prompt=None), instruction "
                f"{DemoSettings.task_instruction.strip()!r}, ReasoningGymScore(extract='final')")
    return (f"arithmetic_task(digits=2, ops='+-', num_train={spec.num_train}, num_test={spec.num_test}, "
            f"seed={spec.task_seed}), instruction {INSTRUCTION.strip()!r}")


def plot(runs: dict[str, list[dict]], path: Path, *, title: str, budget_s: float, subset: int,
         steps: int | None = None) -> None:
    """Subset accuracy against training wall time (with ``steps``: against steps), one line per (engine,
    seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors, styles = {"ours": "tab:blue", "trl": "tab:orange"}, ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(7, 4))
    for engine, rs in runs.items():
        for i, r in enumerate(rs):
            xs = [p["train_s"] if steps is None else p["step"] for p in r["curve"]]
            ys = [p["accuracy"] for p in r["curve"]]
            label = (f"{engine} seed {r['seed']}: {r['steps']} steps; full test {r['before']:.0%} -> "
                     f"{r['after']:.0%}")
            ax.plot(xs, ys, styles[i % len(styles)], color=colors[engine], marker="o", markersize=3,
                    label=label)
    if steps is None:
        ax.axvline(budget_s, color="gray", linestyle=":", linewidth=1, label=f"budget {budget_s:g} s")
        ax.set_xlabel("training wall time (s), evaluation excluded")
    else:
        ax.set_xlabel("optimizer steps")
    ax.set_ylabel(f"greedy accuracy, first {subset} test prompts")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _summary(spec: Spec, seeds: int, first_seed: int, runs: dict[str, list[dict]], errors: list[str],
             out: Path) -> dict:
    """The comparison of the seeds that both engines finished: the JSON last line."""
    paired = [(a, b) for a in runs["ours"] for b in runs["trl"] if a["seed"] == b["seed"]]
    deltas = [100 * (a["after"] - b["after"]) for a, b in paired]
    problems, warnings = _checks(spec, {"ours": [a for a, _ in paired], "trl": [b for _, b in paired]})
    ours, trl = _engine_summary(runs["ours"]), _engine_summary(runs["trl"])
    summary = {"task": _task_name(spec), "budget_s": spec.budget_s if spec.steps is None else None,
               "ours": ours, "trl": trl,
               "delta_after_pts": harness.mean(deltas), "mode": spec.mode, "seeds": seeds,
               "first_seed": first_seed}
    if seeds > 1:
        summary.update(delta_after_pts_runs=deltas, delta_after_pts_std=harness.sd(deltas))
    if spec.steps is not None:
        summary["steps"] = spec.steps
    summary.update(problems=problems, warnings=warnings, errors=list(errors), out=str(out))
    return summary


def compare(spec: Spec, seeds: int, out: Path, first_seed: int = 0) -> dict:
    """Runs the alternating workers for seeds ``first_seed`` .. ``first_seed + seeds - 1`` (seed k even: ours
    then trl; odd: trl then ours); returns the summary. The full report, ``out/report.json``, is rewritten
    after each worker."""
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    errors: list[str] = []

    def report() -> dict:
        return {**_summary(spec, seeds, first_seed, runs, errors, out), "spec": dataclasses.asdict(spec),
                "hardware": harness.hardware(spec.device), "versions": harness.versions(), "runs": runs}

    for seed, engine in harness.schedule(ENGINES, range(first_seed, first_seed + seeds), rotate=True):
        harness.say("learning", f"seed {seed}: {engine} ({spec.mode}, {_budget(spec)})")
        result, error = _run_worker(engine, dataclasses.replace(spec, seed=seed), out)
        if error:
            errors.append(error)
            harness.say("learning", error)
        else:
            runs[engine].append(result)
        harness.write_report(out / "report.json", report())
    # each engine's own batch (they differ in defaults mode)
    shapes = ", ".join(f"{engine} {r[0]['settings']['prompts_per_step']}x{r[0]['settings']['group_size']}"
                       for engine, r in runs.items() if r)
    plot(runs, out / "learning.png",
         title=f"{Path(spec.model).name}, {MODES[spec.mode]}\n{_budget(spec)} "
               f"of training, prompts x completions: {shapes}",
         budget_s=spec.budget_s, subset=spec.eval_subset, steps=spec.steps)
    return _summary(spec, seeds, first_seed, runs, errors, out)


def _table(s: dict) -> str:
    budget = f"{s['budget_s']:g} s" if s["budget_s"] is not None else f"{s['steps']} steps"
    lines = [f"task: {s['task']}",
             f"mode {s['mode']} ({MODES[s['mode']]}), budget {budget} of training, "
             f"{s['seeds']} seed(s) from seed {s['first_seed']}",
             f"{'':6}{'before':>8}{'after':>8}{'steps':>8}{'step s':>9}"]
    for engine in ENGINES:
        e = s[engine]
        if e:
            lines.append(f"{engine:6}{e['before']:8.3f}{e['after']:8.3f}{e['steps']:8.1f}"
                         f"{e['step_s'] or 0:9.2f}")
    lines += [f"{engine} used: {_used(s[engine]['settings'])}" for engine in ENGINES if s[engine]]
    if s["delta_after_pts"] is not None:
        lines.append(f"after, ours - trl: {s['delta_after_pts']:+.1f} points")
    lines += [f"PROBLEM: {x}" for x in s["problems"]] + [f"WARNING: {x}" for x in s["warnings"]]
    lines += [f"ERROR: {x}" for x in s["errors"]] + [f"plot and report: {s['out']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="training wall time per engine (default 480)")
    parser.add_argument("--steps", type=int,
                        help="equal work: each engine trains exactly this many optimizer steps, with no time "
                        "budget (the curve then has a point every --eval-every-steps steps)")
    parser.add_argument("--eval-every-steps", type=int, default=10,
                        help="with --steps: a curve point every this many steps (default 10)")
    parser.add_argument("--mode", choices=tuple(MODES), default="identical",
                        help="identical: the same settings for both engines (default); defaults: "
                        "each engine's recommended settings for this hardware (see the module docstring)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="how many seeds, each runs both engines (default 1)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the first seed (default 0): --first-seed 2 "
                        "--seeds 1 runs seed 2 alone, as the third of --seeds 3 would (same engine order)")
    parser.add_argument("--model", help="a transformers folder (default: the demo's SmolLM2-135M-Instruct)")
    parser.add_argument("--task", default="arithmetic",
                        help="arithmetic (the demo's, default) or rg:FAMILY, a reasoning-gym family")
    parser.add_argument("--task-config", type=json.loads, metavar="JSON",
                        help="with rg:FAMILY: the family's config fields, a JSON object")
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--num-test", type=int, default=64)
    parser.add_argument("--task-seed", type=int, default=0,
                        help="seed of the train/test split (default 0, the demo's)")
    parser.add_argument("--eval-subset", type=int, default=32,
                        help="first test prompts of the accuracy curve")
    parser.add_argument("--eval-every-s", type=float, default=60.0,
                        help="curve point every this much training time")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-completion-tokens", type=int, default=24)
    parser.add_argument("--micro-batch-size", type=int, help="completions per forward/backward, both engines")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, help="output folder (default runs/learning/<timestamp>)")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        harness.emit(worker(args.worker, Spec(**json.loads(args.spec))))
        return 0
    if (args.seeds < 1 or args.first_seed < 0 or args.budget_s <= 0
            or not 1 <= args.eval_subset <= args.num_test):
        parser.error(f"got --seeds {args.seeds}, --first-seed {args.first_seed}, "
                     f"--budget-s {args.budget_s:g}, "
                     f"--eval-subset {args.eval_subset}, --num-test {args.num_test}: need --seeds >= 1, "
                     "--first-seed >= 0, --budget-s > 0 and 1 <= --eval-subset <= --num-test")
    if args.steps is not None and (args.steps < 1 or args.eval_every_steps < 0):
        parser.error(f"got --steps {args.steps}, --eval-every-steps {args.eval_every_steps}: "
                     "need --steps >= 1 and --eval-every-steps >= 0 (0: no curve points between the "
                     "first and the last)")
    if args.model is None:
        from grpo_engine.demo import smollm2_folder

        args.model = str(smollm2_folder())
    family = args.task.startswith("rg:")
    if not (family or args.task == "arithmetic") or (
            args.task_config is not None and not (family and isinstance(args.task_config, dict))):
        parser.error(f"got --task {args.task!r}, --task-config {args.task_config!r}: --task is arithmetic or "
                     "rg:FAMILY, and --task-config a JSON object, with rg:FAMILY only")
    spec = Spec(model=str(args.model), mode=args.mode, task=args.task, task_config=args.task_config,
                budget_s=args.budget_s, steps=args.steps,
                eval_every_steps=args.eval_every_steps, task_seed=args.task_seed,
                num_train=args.num_train, num_test=args.num_test, eval_subset=args.eval_subset,
                eval_every_s=args.eval_every_s, prompts_per_step=args.prompts_per_step,
                group_size=args.group_size,
                max_completion_tokens=args.max_completion_tokens, micro_batch_size=args.micro_batch_size,
                device=args.device)
    out = args.out or harness.ROOT / "runs" / "learning" / time.strftime("%Y%m%d-%H%M%S")
    summary = compare(spec, args.seeds, out, first_seed=args.first_seed)
    print(_table(summary), flush=True)
    print(json.dumps(summary), flush=True)
    return 1 if summary["problems"] or summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
