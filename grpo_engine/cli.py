"""The ``grpo-engine`` command: ``train CONFIG.yaml``, ``demo``, ``example-config``.

The core never imports this module.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from grpo_engine.config import FrozenModel, GRPOConfig
from grpo_engine.memory.plan import LoRA, MemoryPlan

__all__ = ["main"]

EXAMPLE = """\
# grpo-engine train example.yaml
model: HuggingFaceTB/SmolLM2-135M-Instruct      # or a local folder in transformers layout
train_prompts: {function: grpo_engine.data.load_gsm8k, path: ../shared/data/gsm8k/train.jsonl}
rewards:
  - {class: grpo_engine.rewards.MathAccuracy}
  - {class: grpo_engine.rewards.BoxedFormat, weight: 0.1}
loss: {class: grpo_engine.losses.ClippedSurrogate, clip_eps_low: 0.2, clip_eps_high: 0.2}
advantage: {class: grpo_engine.advantages.GroupNormalized}
template: {class: grpo_engine.data.ChatTemplate, instruction: " Put the final answer in \\\\boxed{}."}
config:
  prompts_per_step: 4
  group_size: 8
  max_completion_tokens: 256
  max_steps: 200
  learning_rate: 1.0e-4
  output_dir: runs/gsm8k
memory:
  lora: {r: 16, alpha: 32}
  gradient_checkpointing: true
  optimizer: adamw8bit
  micro_batch_size: 8
"""


def _options(model: type[FrozenModel], prefix: str) -> str:
    lines = []
    for name, field in model.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "null" if default is None else default
        lines.append(f"  {prefix}{name} (default {shown})")
        lines.append(textwrap.indent(textwrap.fill(field.description or "", 88), "      "))
    return "\n".join(lines)


def _train_help() -> str:
    return "\n".join([
        "The YAML file holds: model, train_prompts, rewards, and optionally advantage, loss, template",
        "(components: {class: import.path, **kwargs}), config (GRPOConfig) and memory (MemoryPlan).",
        "Print a complete example with: grpo-engine example-config", "",
        "config options:", _options(GRPOConfig, "config."), "",
        "memory options:", _options(MemoryPlan, "memory."), "",
        "memory.lora options:", _options(LoRA, "memory.lora."),
    ])


def _train(path: str) -> int:
    from grpo_engine.spec import RunSpec, build, format_validation_error

    try:
        spec = RunSpec.from_yaml(path)
    except FileNotFoundError:
        print(f"error: no config file at {path!r}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"error: {path}: {format_validation_error(exc)}", file=sys.stderr)
        return 2
    from grpo_engine.trainer import GRPOTrainer

    prompts = build(spec.train_prompts)
    if isinstance(prompts, tuple) and len(prompts) == 2:
        prompts = prompts[0]
    trainer = GRPOTrainer(
        spec.model, [build(r) for r in spec.rewards], prompts, config=spec.config, memory=spec.memory,
        advantage=build(spec.advantage) if spec.advantage else None,
        loss=build(spec.loss) if spec.loss else None,
        template=build(spec.template) if spec.template else None,
    )
    out = Path(spec.config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec.to_yaml(out / "run.yaml")
    trainer.train()
    print(f"saved to {out / 'final'}; metrics in {out / 'metrics.jsonl'}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from grpo_engine.demo import DemoSettings, run_demo

    run_demo(DemoSettings(train_seconds=args.train_seconds, output_dir=args.output_dir, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``grpo-engine``."""
    parser = argparse.ArgumentParser(
        prog="grpo-engine", description="GRPO training for small reasoning models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a YAML run file", description=_train_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", help="path to the YAML run file")
    from grpo_engine.demo import DemoSettings

    demo = sub.add_parser("demo", help="train SmolLM2-135M-Instruct on arithmetic on this CPU (minutes)",
                          description="Measures held-out accuracy, trains GRPO + LoRA for a wall-clock budget, "
                          "measures again, and prints a JSON summary as its last line.")
    demo.add_argument("--train-seconds", type=float, default=DemoSettings.train_seconds,
                      help="wall-clock training budget in seconds (default %(default)s)")
    demo.add_argument("--output-dir", default=DemoSettings.output_dir,
                      help="metrics.jsonl and reward_curve.png go here (default %(default)s)")
    demo.add_argument("--seed", type=int, default=DemoSettings.seed, help="seed (default %(default)s)")
    sub.add_parser("example-config", help="print a complete example YAML run file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``grpo-engine`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args.config)
    if args.command == "demo":
        return _demo(args)
    print(EXAMPLE, end="")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
