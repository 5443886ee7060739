"""The grpo-engine CLI: help text, config errors, and a real train run on a tiny local model."""

import json

import pytest

from grpo_engine.cli import EXAMPLE, main
from grpo_engine.config import GRPOConfig
from grpo_engine.memory import MemoryPlan
from grpo_engine.memory.budget import plan_for_budget
from grpo_engine.memory.estimate import Workload, estimate_memory
from grpo_engine.spec import RunSpec
from tests.tiny import char_tokenizer, tiny_llama


def test_train_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for name in GRPOConfig.model_fields:
        assert f"config.{name} (default" in text
    for name in MemoryPlan.model_fields:
        assert f"memory.{name} (default" in text


def test_example_config_is_a_valid_run_file(capsys):
    assert main(["example-config"]) == 0
    assert capsys.readouterr().out == EXAMPLE
    spec = RunSpec.from_yaml(EXAMPLE)
    assert spec.memory.optimizer == "adamw8bit" and spec.rewards[1].kwargs == {"weight": 0.1}


def test_bad_config_lists_every_problem_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: x\ntrain_prompts: {function: a.b}\nrewards: []\n"
                    "config: {group_size: 1, tempreature: 1}\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "config.group_size: group_size=1 makes every advantage 0" in err
    assert "config.tempreature: unknown field; did you mean 'temperature'?" in err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2


def test_train_runs_from_yaml_on_a_local_model(tmp_path):
    model_dir = tmp_path / "model"
    tokenizer = char_tokenizer()
    tiny_llama(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a}+{a}", "a": str(2 * a)}) + "\n" for a in range(10, 20)))
    out = tmp_path / "run"
    path = tmp_path / "run.yaml"
    path.write_text(f"""
model: {model_dir}
train_prompts: {{function: grpo_engine.data.load_jsonl_prompts, path: {data}, question_field: q,
                answer_field: a}}
rewards:
  - {{class: grpo_engine.rewards.MathAccuracy}}
  - {{class: tests.test_trainer.DigitShare, weight: 0.5}}
template: {{class: grpo_engine.data.PlainTemplate, format: "{{question}}="}}
config: {{prompts_per_step: 2, group_size: 3, max_completion_tokens: 6, max_steps: 2, output_dir: {out},
          progress_bar: false}}
memory: {{lora: {{r: 2, alpha: 4}}, micro_batch_size: 4}}
imports: [tests]
""")
    assert main(["train", str(path)]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and "reward/digit_share/mean" in json.loads(lines[0])
    assert (out / "final" / "adapter_config.json").is_file()
    assert RunSpec.from_yaml(out / "run.yaml").config.max_steps == 2


def test_plan_prints_the_breakdown_and_a_plan_that_fits(capsys):
    assert main(["plan", "--model", "qwen2.5-1.5b", "--budget-gib", "8", "--completion-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "Without memory savings:" in out and "<- peak" in out and "Chosen for 8 GiB" in out
    plan = MemoryPlan.from_yaml(out.split("memory:  # paste into the run file\n")[1]
                                .replace("\n  ", "\n")[2:])
    workload = Workload(prompts_per_step=4, group_size=8, prompt_tokens=256, completion_tokens=1024)
    assert estimate_memory("qwen2.5-1.5b", plan, workload).peak_gib * 1.15 <= 8


def test_plan_leaves_a_colocated_vllm_engine_its_share(capsys):
    """The engine's share is taken off the budget, and the rest is planned without our sampler's KV cache
    (the engine's share holds its own): the plan chosen is the one that fits 8 GiB with sampler="vllm"."""
    assert main(["plan", "--model", "qwen2.5-1.5b", "--budget-gib", "16", "--vllm-memory-share", "0.5"]) == 0
    shared = capsys.readouterr().out
    assert "vLLM engine: 0.5 x 16 GiB = 8.00 GiB" in shared and "Chosen for 8 GiB" in shared
    plan = MemoryPlan.from_yaml(shared.split("memory:  # paste into the run file\n")[1]
                                .replace("\n  ", "\n")[2:])
    workload = Workload(prompts_per_step=4, group_size=8, prompt_tokens=256, completion_tokens=1024)
    choice = plan_for_budget("qwen2.5-1.5b", workload, 8, sampler="vllm")
    assert plan == choice.plan and choice.estimate.parts["kv_cache"] == 0
    assert main(["plan", "--model", "qwen2.5-1.5b", "--budget-gib", "8"]) == 0
    assert "kv_cache                        1.094" in capsys.readouterr().out  # counted with our sampler
    with pytest.raises(SystemExit):
        main(["plan", "--model", "qwen2.5-1.5b", "--budget-gib", "8", "--vllm-memory-share", "1"])


def test_plan_says_when_nothing_fits(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--budget-gib", "2"]) == 2
    assert "no plan fits 2 GiB" in capsys.readouterr().err
