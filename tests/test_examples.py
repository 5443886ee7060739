"""The examples run top to bottom: each trains one step on a tiny saved model and writes its run folder."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from grpo_engine.models import load_model
from tests.tiny import char_tokenizer, tiny_llama

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = ["--max-steps", "1", "--group-size", "2", "--max-completion-tokens", "8", "--no-progress-bar"]
GSM8K_ROWS = [
    {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
     "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
    for a, b in [(3, 4), (10, 5), (7, 8), (12, 30), (1, 1), (20, 22)]
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices gain nothing from threads, and on a loaded CPU extra threads spin-wait (25x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_example(name, argv):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random tiny Llama and the char tokenizer (with its chat template), saved in transformers layout."""
    folder = tmp_path_factory.mktemp("tiny_model")
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def test_saved_tiny_model_reloads_identically(tiny_folder):
    folder, model, tokenizer = tiny_folder
    reloaded, reloaded_tok = load_model(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 3?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert reloaded_tok(text, add_special_tokens=False)["input_ids"] == ids
    assert len(ids) == len(text)  # still one token per character
    assert reloaded_tok.decode(ids) == text
    assert reloaded_tok.chat_template == tokenizer.chat_template
    assert ((reloaded_tok.pad_token_id, reloaded_tok.eos_token_id)
            == (tokenizer.pad_token_id, tokenizer.eos_token_id))
    assert reloaded.generation_config.eos_token_id == tokenizer.eos_token_id
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def check_run_folder(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["step"] == 1 and "reward/math_accuracy/mean" in record
    assert (out / "final" / "adapter_config.json").is_file()
    return record


@pytest.mark.filterwarnings("ignore:step \\d+. every group has identical rewards")
def test_quickstart(tiny_folder, tmp_path):
    result = run_example("quickstart", ["--model", str(tiny_folder[0]), "--output-dir", str(tmp_path), *TINY])
    check_run_folder(tmp_path)
    assert set(result) == {"before_accuracy", "after_accuracy"}


@pytest.mark.filterwarnings("ignore:step \\d+. every group has identical rewards")
def test_gsm8k_lora(tiny_folder, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    out = tmp_path / "run"
    run_example("gsm8k_lora", ["--model", str(tiny_folder[0]), "--data", str(data), "--output-dir", str(out),
                               "--prompts-per-step", "2", "--eval-every", "1", "--eval-data", str(data),
                               "--eval-size", "2", *TINY])
    record = check_run_folder(out)
    assert "reward/boxed_format/mean" in record and "eval/pass@1" in record


def test_gsm8k_lora_takes_the_plan_that_fits_a_budget(tiny_folder, tmp_path, capsys, monkeypatch):
    from grpo_engine import GRPOTrainer, LoRA, MemoryPlan
    from grpo_engine.memory import Workload, auto_plan

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    plans = []
    monkeypatch.setattr(GRPOTrainer, "train", lambda self: plans.append(self.memory) or [])
    run_example("gsm8k_lora", ["--model", str(tiny_folder[0]), "--data", str(data), "--budget-gib", "0.05",
                               "--output-dir", str(tmp_path / "run"), *TINY])
    # 4 prompts (the default) x 2 completions, 512 + 8 tokens; the base `grpo-engine plan` starts from
    workload = Workload(prompts_per_step=4, group_size=2, prompt_tokens=512, completion_tokens=8)
    base = MemoryPlan(lora=LoRA(r=16), dtype="bfloat16", micro_batch_size=8)
    assert plans == [auto_plan(str(tiny_folder[0]), workload, 0.05, base=base, verbose=False)]
    assert plans[0].dtype == "bfloat16" and "[auto_plan] " in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:step \\d+. every group has identical rewards")
def test_custom_reward(tiny_folder, tmp_path, capsys):
    run_example("custom_reward", ["--model", str(tiny_folder[0]), "--output-dir", str(tmp_path), *TINY])
    printed = capsys.readouterr().out
    assert "bare_integer('12') = 1.0" in printed and "bare_integer('7 + 5 = 12') = 0.5" in printed
    assert "bare_integer('13') = 0.0" in printed
    assert "reward/bare_integer/mean" in check_run_folder(tmp_path)


@pytest.mark.filterwarnings("ignore:step \\d+. every group has identical rewards")
@pytest.mark.filterwarnings("ignore:a prompt of \\d+ tokens")
@pytest.mark.skipif(__import__("grpo_engine.sandbox").sandbox.sandbox_available() is not None,
                    reason="the python tool needs the sandbox (bubblewrap)")
def test_python_tool(tiny_folder, tmp_path):
    result = run_example("python_tool", ["--model", str(tiny_folder[0]), "--output-dir", str(tmp_path),
                                         "--eval-size", "2", "--budget-s", "60", *TINY])
    assert set(result["before"]) == {"greedy", "sampled"} and result["steps"] == 1
    assert set(result["after"]["sampled"]) == {"accuracy", "tool_call_rate", "turns_mean"}
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert {"tools/calls", "turns/mean", "reward/correct/mean"} <= set(record)


@pytest.mark.filterwarnings("ignore:step \\d+. every group has identical rewards")
@pytest.mark.skipif(__import__("grpo_engine.sandbox").sandbox.sandbox_available() is not None,
                    reason="CodeTests needs the sandbox (bubblewrap)")
def test_code_tests(tiny_folder, tmp_path):
    """One step on the code task: every task's asserts convert into call tests (``CodeTests.check``), and
    the held-out pass rates are fractions of tests passed."""
    result = run_example("code_tests", ["--model", str(tiny_folder[0]), "--output-dir", str(tmp_path),
                                        "--eval-size", "2", "--budget-s", "60", *TINY])
    assert set(result["before"]) == {"pass_rate_greedy", "pass_rate_sampled"} and result["steps"] == 1
    assert all(0.0 <= v <= 1.0 for v in result["after"].values())
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/code_tests/mean" in record
