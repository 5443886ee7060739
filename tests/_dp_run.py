"""Data-parallel runs for tests/test_distributed.py: the same cases under torchrun and in one process.

    torchrun --standalone --nproc_per_node 2 tests/_dp_run.py OUT CASE [CASE ...] [--resume-step N]
    python tests/_dp_run.py OUT CASE ...     # one process

Each case trains a tiny model for 2 steps (the demo, curriculum and dynamic cases 3) and writes
``OUT/<case>/rank<r>.pt``: the summed gradient of every step (captured just before
``optimizer.step()``), the trained weights after every step, the logged metrics (times left out) and,
with ``PoolRecorder``, each micro-batch's entropy pool.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo_engine import GRPOConfig, GRPOTrainer, HeldOutEval, LoRA, MemoryPlan  # noqa: E402
from grpo_engine.advantages import GroupNormalized, ReinforcePlusPlusBaseline  # noqa: E402
from grpo_engine.checkpoint import Resume  # noqa: E402
from grpo_engine.data import ChatTemplate, InformativeCurriculum, PlainTemplate, arithmetic_task  # noqa: E402
from grpo_engine.distributed import full_value  # noqa: E402
from grpo_engine.entropy import AdaptiveTemperature, SemanticEntropy  # noqa: E402
from grpo_engine.losses import ClippedSurrogate  # noqa: E402
from grpo_engine.memory.apply import trainable_parameters  # noqa: E402
from grpo_engine.presets import dr_grpo  # noqa: E402
from grpo_engine.rewards import KLRewardPenalty, MathAccuracy, Reward  # noqa: E402
from grpo_engine.sampling import DynamicSampling  # noqa: E402
from grpo_engine.types import Prompt  # noqa: E402
from tests.tiny import char_tokenizer, tiny_llama  # noqa: E402

C = 8  # completion tokens
SUMS = [(a, b) for a in range(3, 9) for b in range(2, 5)]


class DigitShare(Reward):
    """Fraction of the completion's characters that are digits (varies a lot on a random model)."""

    def score(self, prompt, completion):
        return sum(c.isdigit() for c in completion) / max(1, len(completion))


class StartsWithDigit(Reward):
    """1 when the completion starts with a digit: groups of a random model often tie (all 0)."""

    def score(self, prompt, completion):
        return float(completion[:1].isdigit())


class PoolRecorder:
    """``ClippedSurrogate(top_entropy_quantile=0.2)`` that records, per micro-batch, this rank's valid-token
    entropies and the pool its threshold was taken over (``MicroBatch.entropy_pool``, which the trainer
    gathers from every rank's ``pooled_entropy``)."""

    def __init__(self):
        self.inner = ClippedSurrogate(top_entropy_quantile=0.2)
        self.requires, self.pools = self.inner.requires, []

    def counts(self, completion_mask, is_truncated=None):
        return self.inner.counts(completion_mask, is_truncated)

    def pooled_entropy(self, batch):
        return self.inner.pooled_entropy(batch)

    def __call__(self, logprobs, batch, **counts):
        self.pools.append((self.inner.pooled_entropy(batch).clone(), batch.entropy_pool.clone()))
        return self.inner(logprobs, batch, **counts)


class Eval(HeldOutEval):
    """Held-out pass@1 at every step (rank 0 evaluates; under FSDP2 with the whole model gathered)."""

    def __init__(self):
        super().__init__([Prompt(f"{a}+{a}=", str(2 * a)) for a in range(2, 6)], every_steps=1,
                         max_new_tokens=4)


def case(name: str) -> dict:
    """The trainer's settings of one case: LoRA unless said, 4 prompts x 4 completions per step."""
    lora = MemoryPlan(lora=LoRA(r=4), micro_batch_size=4)
    cases = {
        "sequence": dict(loss=ClippedSurrogate(aggregation="sequence"), memory=lora),
        # full FT
        "token": dict(loss=ClippedSurrogate(aggregation="token"), memory=MemoryPlan(micro_batch_size=3)),
        "constant": dict(loss=ClippedSurrogate(aggregation="constant", max_completion_tokens=C),
                         advantage=GroupNormalized(std_scope="none"), memory=lora),
        "batch_std": dict(advantage=GroupNormalized(std_scope="batch"), memory=lora),
        "reinforce_pp": dict(advantage=ReinforcePlusPlusBaseline(),
                             loss=ClippedSurrogate(aggregation="token"), memory=lora),
        # reference pass, transform
        "kl_reward": dict(rewards=[DigitShare(), KLRewardPenalty(0.5)], memory=lora),
        "curriculum": dict(curriculum=True, entropy=SemanticEntropy(), memory=lora,
                           callbacks=[AdaptiveTemperature(collapse_fraction=0.0, step=0.1)]),
        "dynamic": dict(sampler=DynamicSampling(max_rounds=3), rewards=[StartsWithDigit()], memory=lora),
        "top_entropy": dict(loss=ClippedSurrogate(top_entropy_quantile=0.2),  # one micro-batch per rank
                            memory=MemoryPlan(lora=LoRA(r=4), micro_batch_size=16)),
        "dynamic_top_entropy": dict(sampler=DynamicSampling(max_rounds=3), rewards=[StartsWithDigit()],
                                    loss=PoolRecorder(),
                                    memory=MemoryPlan(lora=LoRA(r=4), micro_batch_size=2)),
        "fsdp_lora": dict(memory=MemoryPlan(lora=LoRA(r=4), micro_batch_size=4, sharding="fsdp",
                                            merge_lora_for_sampling=True), callbacks=[Eval()]),
        "fsdp_full": dict(loss=ClippedSurrogate(aggregation="token"), memory=MemoryPlan(micro_batch_size=3,
                                                                                        sharding="fsdp")),
        "fsdp_top_entropy": dict(loss=ClippedSurrogate(top_entropy_quantile=0.2),
                                 memory=MemoryPlan(micro_batch_size=16, sharding="fsdp")),
        "demo": dict(memory=MemoryPlan(lora=LoRA(r=16), micro_batch_size=16, merge_lora_for_sampling=True),
                     demo=True, **dr_grpo(16).components()),
    }
    return cases[name]


def build_tools(out: Path, steps: int, resume: str | None) -> GRPOTrainer:
    """Multi-turn rollouts with a tool (tests/test_tools.py's model, whose turns end soon, and a parser that
    calls the tool every turn)."""
    from tests.test_tools import TEMPLATE, EveryTurnCalls, echo, turn_taking_model

    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(1)
    config = GRPOConfig(prompts_per_step=4, group_size=4, max_completion_tokens=40, max_prompt_tokens=1024,
                        learning_rate=3e-4, max_steps=steps, seed=3, max_turns=3, output_dir=str(out),
                        progress_bar=False)
    prompts = [Prompt(f"{a}+{b}=", str(a + b)) for a, b in SUMS]
    trainer = GRPOTrainer(turn_taking_model(tokenizer), [DigitShare()], prompts, config,
                          MemoryPlan(lora=LoRA(r=4), micro_batch_size=4), tokenizer=tokenizer, tools=[echo],
                          resume_from=Resume(resume, frozenset({"config.output_dir"})) if resume else None)
    trainer.sampler.parser = EveryTurnCalls()
    return trainer


def build(name: str, out: Path, steps: int, resume: str | None = None) -> GRPOTrainer:
    if name == "tools":
        return build_tools(out, steps, resume)
    settings = case(name)
    demo, curriculum = settings.pop("demo", False), settings.pop("curriculum", False)
    tokenizer = char_tokenizer()
    if demo:  # the demo's task, recipe and schedule on the tiny model (which needs a reward with signal)
        prompts, _ = arithmetic_task(40, 4, seed=0)
        config = GRPOConfig(prompts_per_step=8, group_size=4, max_completion_tokens=16, learning_rate=3e-4,
                            lr_schedule="cosine", max_steps=steps, seed=0, output_dir=str(out),
                            progress_bar=False)
        rewards, template = [MathAccuracy(isolate=False), DigitShare()], ChatTemplate(instruction=" Reply.")
    else:
        prompts = [Prompt(f"{a}+{b}=", str(a + b)) for a, b in SUMS]
        # the demo's peak lr: AdamW divides each gradient by its running RMS, which turns the float32
        # summation-order difference of a near-zero gradient (~1e-9) into up to ~3e-3 lr of weight
        config = GRPOConfig(prompts_per_step=4, group_size=4, max_completion_tokens=C, learning_rate=3e-4,
                            max_steps=steps, seed=3, output_dir=str(out), progress_bar=False)
        rewards, template = settings.pop("rewards", [DigitShare()]), PlainTemplate("{question}")
        if curriculum:  # what it serves next depends on every group's accuracy so far
            prompts = InformativeCurriculum(prompts, batch_size=4, seed=3, accuracy_reward="digit_share")
    return GRPOTrainer(tiny_llama(len(tokenizer), seed=1), rewards, prompts, config, tokenizer=tokenizer,
                       template=template, **settings,
                       resume_from=Resume(resume, frozenset({"config.output_dir"})) if resume else None)


def steps_of(name: str) -> int:
    return 3 if name in ("demo", "curriculum", "dynamic", "dynamic_top_entropy") else 2


def run(name: str, out: Path, resume: str | None = None) -> dict:
    """Trains one case; returns (and writes, per rank) its gradients, weights and metrics."""
    steps = steps_of(name)
    (out / name).mkdir(parents=True, exist_ok=True)
    trainer = build(name, out / name, steps, resume)
    record: dict = {"grads": [], "weights": [], "metrics": [], "pools": []}
    step = trainer.optimizer.step

    @functools.wraps(step)  # keeps torch's scheduler marker: no "optimizer.step() has been overridden"
    def recording_step(*args, **kwargs):
        record["grads"].append([full_value(p.grad).detach().clone()
                                for p in trainable_parameters(trainer.model)])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    while trainer.step_count < steps:
        metrics = trainer.step()
        record["weights"].append([full_value(p).detach().clone()
                                  for p in trainable_parameters(trainer.model)])
        record["metrics"].append({k: v for k, v in metrics.items()
                                  if not k.startswith(("time/", "tokens/generated_"))})
        if isinstance(trainer.loss, PoolRecorder):
            record["pools"].append(list(trainer.loss.pools))
            trainer.loss.pools.clear()
        if not resume:
            trainer.save(out / name / f"checkpoint-{trainer.step_count}")
    file = f"resumed-rank{trainer.world.rank}.pt" if resume else f"rank{trainer.world.rank}.pt"
    torch.save(record, out / name / file)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--resume-step", type=int, help="resume each case from its OUT/<case>/checkpoint-N")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.cases:
        resume = (None if args.resume_step is None
                  else str(Path(args.out) / name / f"checkpoint-{args.resume_step}"))
        run(name, Path(args.out), resume)
    if torch.distributed.is_initialized():  # every rank done before any tears its group down: a rank that
        torch.distributed.barrier()  # left first once aborted in gloo's teardown under load (std::terminate)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
