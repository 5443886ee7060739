"""The ``grpo-engine`` command: ``train CONFIG.yaml``, ``eval``, ``plan``, ``export``, ``demo``,
``example-config``.

The core never imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from grpo_engine.config import ConfigError, FrozenModel, GRPOConfig, load_yaml
from grpo_engine.memory.plan import LoRA, MemoryPlan

__all__ = ["main"]

EXAMPLE_DATA = {
    None: "{{function: grpo_engine.data.arithmetic_task, num_train: 1000, num_test: 64}}"
          "   # bundled synthetic task",
    "gsm8k": "{{function: grpo_engine.data.load_gsm8k, path: {path}}}",
    "jsonl": "{{function: grpo_engine.data.load_jsonl_prompts, path: {path}, question_field: question, "
             "answer_field: answer}}",
}


def example_config(data: str | None = None, model: str = "HuggingFaceTB/SmolLM2-135M-Instruct") -> str:
    """A complete, runnable run file: on ``data`` (a GSM8K or JSONL file) or the bundled arithmetic task."""
    kind = None if data is None else "gsm8k" if "gsm8k" in str(data).lower() else "jsonl"
    prompts = EXAMPLE_DATA[kind].format(path=json.dumps(str(data)) if data else "")
    tokens = 256 if kind else 32
    return f"""\
# grpo-engine train run.yaml
model: {model}      # or a local folder in transformers layout
train_prompts: {prompts}
rewards:
  - {{class: grpo_engine.rewards.MathAccuracy}}
  - {{class: grpo_engine.rewards.BoxedFormat, weight: 0.1}}
loss: {{class: grpo_engine.losses.ClippedSurrogate, clip_eps_low: 0.2, clip_eps_high: 0.2}}
advantage: {{class: grpo_engine.advantages.GroupNormalized}}
template: {{class: grpo_engine.data.ChatTemplate, instruction: " Put the final answer in \\\\boxed{{}}."}}
config:
  prompts_per_step: 4
  group_size: 8
  max_completion_tokens: {tokens}
  max_steps: 200
  learning_rate: 1.0e-4
  save_every_steps: 50
  output_dir: runs/example
memory:
  lora: {{r: 16, alpha: 32}}
  gradient_checkpointing: true
  optimizer: adamw8bit
  micro_batch_size: 8
"""


EXAMPLE = example_config()


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
        "The YAML file holds: model, train_prompts, rewards, and optionally advantage, loss, template,",
        "sampler, entropy, callbacks (components: {class: import.path, **kwargs}), config (GRPOConfig)",
        "and memory (MemoryPlan).", "",
        "Trust: an import path runs code. A run file may call grpo_engine.* freely, and anything else only",
        "under a module it lists in 'imports:' (e.g. imports: [my_rewards]); read that code before running a",
        "run file someone shared.", "",
        "Resume: 'grpo-engine train run.yaml --resume' continues the run in config.output_dir from its",
        "newest checkpoint (config.save_every_steps), bit for bit; a changed setting is refused by name,",
        "and the safe ones (config.max_steps, ...) may change with --allow-change FIELD.",
        "Print a complete example with: grpo-engine example-config", "",
        "config options:", _options(GRPOConfig, "config."), "",
        "memory options:", _options(MemoryPlan, "memory."), "",
        "memory.lora options:", _options(LoRA, "memory.lora."),
    ])


def _train(args: argparse.Namespace) -> int:
    from grpo_engine import checkpoint
    from grpo_engine.data.errors import DataError
    from grpo_engine.spec import BuildError, RunSpec, build, loss_of, rewards_of

    path = args.config
    try:
        data = load_yaml(Path(path))
        spec = RunSpec.model_validate(_overridden(data if data is not None else {}, args.set))
    except FileNotFoundError:
        print(f"error: no config file at {path!r}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"error: {path}{' with --set' if args.set else ''}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a malformed --set
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(spec.config.output_dir)
    problem = _resume_problem(spec, out) if args.resume else checkpoint.used_output_dir(out)
    if args.allow_change and not args.resume:
        problem = "--allow-change only applies with --resume"
    if problem:  # refused before anything is loaded or written
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from grpo_engine.trainer import GRPOTrainer

    try:
        prompts = build(spec.train_prompts)
        if isinstance(prompts, tuple) and len(prompts) == 2:
            prompts = prompts[0]
        callbacks = [build(c) for c in spec.callbacks]
        trainer = GRPOTrainer(
            spec.model, rewards_of(spec), prompts, config=spec.config, memory=spec.memory,
            advantage=build(spec.advantage) if spec.advantage else None,
            loss=loss_of(spec, callbacks),  # with the callbacks that are loss terms too
            template=build(spec.template) if spec.template else None,
            sampler=build(spec.sampler) if spec.sampler else None,
            entropy=build(spec.entropy) if spec.entropy else None,
            callbacks=callbacks,
            resume_from=checkpoint.Resume("latest", frozenset(args.allow_change)) if args.resume else None,
        )
    except (BuildError, DataError, checkpoint.ResumeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    main = trainer.world.is_main  # under torchrun, rank 0 writes and speaks
    if main:
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.write_text_atomic(out / "run.yaml", spec.to_yaml())  # only once every check has passed
    if trainer.resumed_from is not None and main:
        print(f"resuming from {trainer.resumed_from} (step {trainer.step_count})")
    trainer.train()
    if main:
        print(f"saved to {out / 'final'}; metrics in {out / 'metrics.jsonl'}")
    return 0


def _overridden(data: Any, settings: Sequence[str]) -> Any:
    """The run file's data with each ``--set dotted.path=value`` applied (the value read as YAML)."""
    if not isinstance(data, dict):
        raise ValueError("the run file must be a YAML mapping (model: ..., rewards: ...), got "
                         f"{type(data).__name__}")
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"--set {setting!r}: write FIELD=VALUE, e.g. --set config.learning_rate=1e-4")
        value = yaml.safe_load(text) if text.strip() else None
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 as text
            for kind in (int, float):
                try:
                    value = kind(value)
                    break
                except ValueError:
                    pass
        node = data
        *parents, last = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"--set {setting!r}: {part!r} is {child!r}, not a section with fields")
            node = child
        node[last] = value
    return data


def _resume_problem(spec: Any, out: Path) -> str | None:
    """Why ``spec`` cannot continue the run in ``out``: components that differ from its run.yaml (the
    trainer checks the config and memory settings itself, when it restores)."""
    from grpo_engine.spec import RunSpec

    saved_file = out / "run.yaml"
    if not saved_file.is_file():
        return None  # the trainer says whether there is a checkpoint to resume
    saved = RunSpec.from_yaml(saved_file).model_dump(mode="json", exclude={"config", "memory"})
    now = spec.model_dump(mode="json", exclude={"config", "memory"})
    changed = [key for key in now if now[key] != saved.get(key)]
    if changed:
        return (f"cannot resume the run in {out}: {', '.join(changed)} differ from its run.yaml; "
                "resume with the saved run file (cp run.yaml), or start a new run in another output_dir")
    return None


def _demo(args: argparse.Namespace) -> int:
    from grpo_engine.demo import DemoSettings, run_demo

    run_demo(DemoSettings(train_seconds=args.train_seconds, max_steps=args.max_steps, task=args.task,
                          task_config=args.task_config, output_dir=args.output_dir, seed=args.seed))
    return 0


def _demo_task(text: str) -> str:
    """``--task``: a built-in task's name, or a reasoning-gym family's (``rg:`` optional), bare."""
    from grpo_engine.demo import BUILT_IN_TASKS

    if text in BUILT_IN_TASKS:
        return text
    family = text.removeprefix("rg:")
    from grpo_engine.data.errors import DataError
    from grpo_engine.tasks.reasoning_gym import check_family, require_reasoning_gym

    try:
        require_reasoning_gym()
        check_family(family)
    except (ImportError, DataError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not {' or '.join(BUILT_IN_TASKS)}, and {exc}") from exc
    return family


def _task_config(text: str) -> dict:
    """``--task-config``: a JSON object."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc}); pass an object, e.g. "
                                         "'{\"max_value\": 100}'") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; pass an object, e.g. "
                                         "'{\"max_value\": 100}'")
    return config


def _eval_prompts(args: argparse.Namespace) -> list:
    from grpo_engine.data.errors import DataError
    from grpo_engine.data.loaders import load_gsm8k, load_jsonl_prompts, load_math500

    if args.dataset != "jsonl" and (args.question_field or args.answer_field):
        raise DataError("--question-field/--answer-field apply to --dataset jsonl only; "
                        f"--dataset {args.dataset} knows its fields")
    if args.dataset == "gsm8k":  # no --data: the hub's openai/gsm8k (needs the network)
        return load_gsm8k(args.data, split=args.split, limit=args.limit)
    if args.data is None:
        raise DataError(f"--dataset {args.dataset} needs --data PATH (a local JSONL file, e.g. MATH-500's "
                        "test.jsonl)")
    if args.dataset == "math500":
        return load_math500(args.data, limit=args.limit)
    return load_jsonl_prompts(args.data, question_field=args.question_field or "question",
                              answer_field=args.answer_field or "answer", limit=args.limit)


def _eval(args: argparse.Namespace) -> int:
    import torch

    from grpo_engine.data.errors import DataError
    from grpo_engine.data.templates import default_template
    from grpo_engine.eval import evaluate
    from grpo_engine.models import load_model
    from grpo_engine.rewards.function import FunctionReward
    from grpo_engine.rewards.math import MathAccuracy
    from grpo_engine.sampling.hf import HFSampler
    from grpo_engine.spec import BuildError, load
    from grpo_engine.tools.rollout import ToolSampler

    try:  # import paths name the user's objects (their code runs): the reward, tools, environment, parser
        reward = MathAccuracy() if args.reward is None else load(args.reward)
        reward = reward() if isinstance(reward, type) else reward
        reward = reward if hasattr(reward, "name") else FunctionReward(reward)  # TRL's reward function
        tools = [load(path.strip()) for path in args.tools.split(",") if path.strip()] if args.tools else []
        environment = load(args.environment) if args.environment else None
        if not (tools or environment) and (args.max_turns or args.parser):
            raise BuildError("--max-turns and --parser apply to multi-turn evaluation; add --tools "
                             "module:function or --environment module:Class, or leave them out")
        parser = load(args.parser)() if args.parser else None
        prompts = _eval_prompts(args)
        model, tokenizer = load_model(args.model, dtype=args.dtype)
    except (DataError, OSError, BuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.adapter:
        from peft import PeftModel

        from grpo_engine._quiet import quiet_peft

        with quiet_peft():
            model = PeftModel.from_pretrained(model, args.adapter)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    template = default_template(tokenizer, system=args.template_system, instruction=args.template_instruction)
    sampler = None
    if tools or environment:  # multi-turn rollouts; --max-new-tokens is each rollout's budget
        try:
            sampler = ToolSampler(HFSampler(model, tokenizer, template=template, max_prompt_tokens=10**9,
                                            max_completion_tokens=args.max_new_tokens, return_logprobs=False),
                                  tools=tools, environment_factory=environment, parser=parser,
                                  max_turns=args.max_turns or 4)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    report = evaluate(model, tokenizer, prompts, reward, template=template, k=args.k,
                      temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                      batch_size=args.batch_size, seed=args.seed, greedy=not args.no_greedy,
                      progress=not args.no_progress_bar, sampler=sampler)
    run = {"model": args.model, "adapter": args.adapter, "dataset": args.dataset, "data": args.data,
           "split": args.split if args.dataset == "gsm8k" and args.data is None else None,
           "limit": args.limit, "dtype": args.dtype, "device": device}
    report = dataclasses.replace(report, settings={**run, **report.settings})
    report.to_json(args.output)
    print(report.table())
    print(f"report written to {args.output}")
    return 0


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="pass@1 / pass@k / maj@k of a model on GSM8K, MATH-500 or a JSONL file",
        description="Greedy pass@1 and, with --k > 1, k samples per prompt (avg@k = sampled pass@1, unbiased "
        "pass@k, maj@k), scored with MathAccuracy (math-verify) or --reward; with --tools / --environment, "
        "of multi-turn rollouts in which the model calls them. Writes a JSON report and prints a table.")
    p.add_argument("--model", required=True, help="local folder in transformers layout, or a hub id")
    p.add_argument("--adapter", help="a peft adapter folder (e.g. runs/x/final from LoRA training) to apply")
    p.add_argument("--dataset", required=True, choices=["gsm8k", "math500", "jsonl"], help="the data format")
    p.add_argument("--data", help="the JSONL file; without it, --dataset gsm8k downloads openai/gsm8k")
    p.add_argument("--split", default="test", help="hub split when --data is not given (default %(default)s)")
    p.add_argument("--question-field", help="--dataset jsonl: the question field (default question)")
    p.add_argument("--answer-field", help="--dataset jsonl: the reference-answer field (default answer)")
    p.add_argument("--limit", type=_positive(int), help="evaluate only the first N records")
    p.add_argument("--k", type=_positive(int), default=1, help="samples per prompt; > 1 adds avg@k, "
                   "pass@k, maj@k (default %(default)s: greedy only)")
    p.add_argument("--no-greedy", action="store_true", help="skip greedy decoding (sampled metrics only)")
    p.add_argument("--temperature", type=_positive(float), default=1.0,
                   help="sampling temperature (default %(default)s)")
    p.add_argument("--max-new-tokens", type=_positive(int), default=256,
                   help="generation limit (default %(default)s)")
    p.add_argument("--batch-size", type=_positive(int), default=32,
                   help="completions per decoding call (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--template-instruction", default="", help="text appended to each question, e.g. "
                   "' Put the final answer in \\boxed{}.' (default none)")
    p.add_argument("--template-system", help="a system message (default none)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default %(default)s)")
    p.add_argument("--device", help="torch device (default cuda when available, else cpu)")
    p.add_argument("--no-progress-bar", action="store_true", help="no progress bar")
    p.add_argument("--reward", help="import path (module:name) of a reward class, object or TRL-style reward "
                   "function that decides correctness; with tools it may read the episode and environment "
                   "(default MathAccuracy)")
    p.add_argument("--tools", help="comma-separated import paths of tool functions (module:function,...): "
                   "multi-turn evaluation in which the model calls them (their code runs)")
    p.add_argument("--environment", help="import path (module:Class) of an environment factory, one per "
                   "rollout; its public methods are tools, rewards may read it")
    p.add_argument("--max-turns", type=_positive(int), help="model turns per rollout with tools (default 4)")
    p.add_argument("--parser", help="import path (module:Class) of the tool-call parser, built without "
                   "arguments (default grpo_engine.tools:HermesParser)")
    p.add_argument("--output", required=True, help="path of the JSON report (written atomically)")


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share in [0, 1) of the accelerator's memory; "
                                         "e.g. 0.3")
    return value


def _plan(args: argparse.Namespace) -> int:
    from grpo_engine.memory.budget import plan_for_budget
    from grpo_engine.memory.estimate import Workload, estimate_memory

    try:
        workload = Workload(prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                            prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens,
                            kl=args.kl).per_rank(args.ranks)
        base = MemoryPlan(lora=None if args.full_finetune else LoRA(r=args.lora_r), sharding=args.sharding,
                          dtype=args.dtype, micro_batch_size=args.micro_batch_size or workload.rows)
        print(f"model {args.model}; {workload.prompts_per_step} prompts x {workload.group_size} completions, "
              f"{workload.prompt_tokens} + {workload.completion_tokens} tokens{', KL' if workload.kl else ''}"
              f"{f' per rank ({args.ranks} ranks, sharding {args.sharding})' if args.ranks > 1 else ''}\n")
        print("Without memory savings:")
        sampler = "vllm" if args.vllm_memory_share else "ours"  # the engine's share holds its KV cache
        print(estimate_memory(args.model, base, workload, ranks=args.ranks, sampler=sampler).table())
        budget = args.budget_gib * (1 - args.vllm_memory_share)  # a colocated vLLM engine takes its share
        if args.vllm_memory_share:
            print(f"\nvLLM engine: {args.vllm_memory_share:g} x {args.budget_gib:g} GiB = "
                  f"{args.budget_gib - budget:.2f} GiB (VLLMSampler(gpu_memory_utilization="
                  f"{args.vllm_memory_share:g})); training plans for the other {budget:.2f} GiB, "
                  "without our sampler's KV cache")
        choice = plan_for_budget(args.model, workload, budget, base=base, margin=args.margin,
                                 ranks=args.ranks, sampler=sampler)
    except ValueError as exc:  # ConfigError included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"\nChosen for {budget:g} GiB: {choice.reason}\n")
    print(choice.estimate.table())
    print("\nmemory:  # paste into the run file")
    print(textwrap.indent(choice.plan.to_yaml(), "  "), end="")
    return 0


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="predict peak accelerator memory and choose a MemoryPlan that fits a budget",
        description="Prints the predicted memory by part and phase without savings, then the plan with the "
        "least estimated slowdown whose peak (plus a margin) fits --budget-gib, as YAML for a run file. "
        "Predicts tensor memory (torch.cuda.max_memory_allocated); the CUDA context (~0.3-0.5 GiB) comes "
        "on top.")
    p.add_argument("--model", required=True, help="a folder with config.json, a hub id (online), or one of "
                   "qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, llama-3.2-1b, smollm2-135m")
    p.add_argument("--budget-gib", type=_positive(float), required=True, help="accelerator memory, GiB")
    p.add_argument("--prompts-per-step", type=_positive(int), default=4, help="B (default %(default)s)")
    p.add_argument("--group-size", type=_positive(int), default=8, help="G (default %(default)s)")
    p.add_argument("--ranks", type=_positive(int), default=1, help="torchrun processes: each samples and "
                   "trains prompts-per-step / ranks prompts (default %(default)s)")
    p.add_argument("--sharding", default="none", choices=["none", "fsdp"], help="with --ranks: none "
                   "(each rank holds the whole model) or fsdp (FSDP2 shards it; default %(default)s)")
    p.add_argument("--prompt-tokens", type=_positive(int), default=256, help="P (default %(default)s)")
    p.add_argument("--completion-tokens", type=_positive(int), default=1024, help="C (default %(default)s)")
    p.add_argument("--kl", action="store_true", help="a KL term (a reference copy under full fine-tuning)")
    p.add_argument("--lora-r", type=_positive(int), default=16, help="LoRA rank (default %(default)s)")
    p.add_argument("--full-finetune", action="store_true", help="train every weight instead of LoRA")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default %(default)s)")
    p.add_argument("--micro-batch-size", type=_positive(int),
                   help="largest micro-batch to consider (default B*G)")
    p.add_argument("--margin", type=float, default=0.15,
                   help="safety margin on the prediction (default %(default)s)")
    p.add_argument("--vllm-memory-share", type=_share, default=0.0,
                   help="the share of the accelerator a colocated vLLM engine takes "
                   "(VLLMSampler(gpu_memory_utilization=...)); the plan fits the rest (default %(default)s)")


def _export(args: argparse.Namespace) -> int:
    from grpo_engine.export import export_run

    try:
        out = export_run(args.run, args.merge, base=args.base, dtype=args.dtype)
    except (FileNotFoundError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}: a plain transformers folder (AutoModelForCausalLM.from_pretrained({str(out)!r}))")
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
    train.add_argument("--set", action="extend", nargs="+", default=[], metavar="FIELD=VALUE",
                       help="override a setting of the run file, validated like the file, e.g. --set "
                       "config.learning_rate=1e-4 memory.lora.r=32")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in config.output_dir from its newest checkpoint, exactly")
    train.add_argument("--allow-change", action="append", default=[], metavar="FIELD",
                       help="with --resume: a safe setting that may differ from the saved run, e.g. "
                       "config.max_steps (repeat for several)")
    _add_eval_parser(sub)
    _add_plan_parser(sub)
    from grpo_engine.demo import DemoSettings

    demo = sub.add_parser("demo", help="train SmolLM2-135M-Instruct on arithmetic on this CPU (minutes)",
                          description="Measures held-out accuracy, trains GRPO + LoRA (the step count fixed "
                          "by timing the warm-up and steps 5-20 against the budget), measures again, and "
                          "prints a JSON summary as its last line.")
    demo.add_argument("--task", type=_demo_task, default=DemoSettings.task,
                      help="arithmetic (two-digit + / - problems), comparison (the largest / smallest of "
                      "three numbers), or a reasoning-gym family, rg:FAMILY or its bare name, e.g. "
                      "rg:leg_counting (needs pip install 'grpo-engine[tasks]'; default %(default)s)")
    demo.add_argument("--task-config", type=_task_config, metavar="JSON",
                      help="a reasoning-gym family's config fields as a JSON object, e.g. "
                      "'{\"max_value\": 100}' with rg:gcd (default: the family's own)")
    demo.add_argument("--max-steps", type=int, default=DemoSettings.max_steps,
                      help="steps to train when they fit in the budget (default %(default)s)")
    demo.add_argument("--train-seconds", type=float, default=DemoSettings.train_seconds,
                      help="the training budget in seconds; a slower machine trains fewer steps "
                      "(default %(default)s)")
    demo.add_argument("--output-dir", default=DemoSettings.output_dir,
                      help="metrics.jsonl and reward_curve.png go here (default %(default)s)")
    demo.add_argument("--seed", type=int, default=DemoSettings.seed, help="seed (default %(default)s)")
    export = sub.add_parser("export", help="merge a run's LoRA adapter into its base model: a plain "
                            "transformers folder", description="Loads the base model (the run's run.yaml "
                            "model, or --base), applies the newest checkpoint's adapter (or the folder "
                            "given), merges it and writes the weights and tokenizer to --merge OUT.")
    export.add_argument("run", help="a run folder, or its final/ or checkpoint-N/ folder")
    export.add_argument("--merge", required=True, metavar="OUT", help="the folder to write")
    export.add_argument("--base", help="the base model (default: the run's model)")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype to load and save in (default %(default)s)")
    example = sub.add_parser("example-config", help="print a complete, runnable YAML run file")
    example.add_argument("--data", help="a GSM8K or JSONL file of question/answer records (default: the "
                         "bundled arithmetic task)")
    example.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                         help="a hub id or local transformers folder (default %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``grpo-engine`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "export":
        return _export(args)
    print(example_config(args.data, args.model), end="")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
