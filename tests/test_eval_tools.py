"""Multi-turn evaluation (issue 54): ``evaluate`` with a ToolSampler, ``HeldOutEval`` of a trainer with tools
and ``grpo-engine eval --tools / --environment``, on a scripted model whose answer is right only when it reads
the tool's reply, so pass@1, avg@k, pass@k, maj@k and the turn counts have hand values; the single-turn
report is the one it was before (its keys and values, by hand)."""

from __future__ import annotations

import json
from collections import Counter
from typing import ClassVar

import pytest
import torch

from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan
from grpo_engine.callbacks import HeldOutEval
from grpo_engine.cli import main
from grpo_engine.eval import EvalReport, evaluate
from grpo_engine.rewards import MathAccuracy
from grpo_engine.rewards.function import FunctionReward
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.tools import ToolSampler
from grpo_engine.types import Draws, Prompt
from tests.tiny import char_tokenizer, tiny_llama

# no frames but the tool's header, and no generation prompt: the model's first token follows the last
# character of the user's question or of the tool's reply
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}<tool>{% endif %}{{ m['content'] }}"
            "{% endfor %}")
CODE = "abcdefghij"  # the tool writes digit d as CODE[d]; the model reads it back as d


def scripted_model(tok):
    """A Llama whose next token depends on the current one only (attention and MLP write nothing; one-hot
    embeddings; a head with a margin of 45 logits, so sampling at temperature 1 is the script too):
    '?' -> 'C' (a call), '!' -> 'x' (a guess), a letter of CODE -> its digit, anything else -> EOS."""
    model = tiny_llama(len(tok), hidden=128)
    vocab = tok.get_vocab()
    script = {"?": "C", "!": "x", **{letter: str(d) for d, letter in enumerate(CODE)}}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(len(tok), 128))
        head = torch.zeros(len(tok), 128)
        head[vocab["<eos>"], :len(tok)] = 4.0
        for now, then in script.items():
            head[vocab[then], vocab[now]] = 8.0
        model.lm_head.weight.copy_(head)
    return model.eval()


class CallsOnC:
    """The tool-call format of the scripted model: a turn that starts with 'C' calls ``lookup``."""

    stop_text = None

    def parse(self, text):
        return [{"name": "lookup", "arguments": {}}] if text.startswith("C") else []

    def system_prompt(self, schemas):
        return "tools: " + ", ".join(s["function"]["name"] for s in schemas) + "\n"


class Oracle:
    """Knows each question's answer; ``plan`` (a prompt's metadata) says, for the question's rollouts in the
    order they start, whether ``lookup`` tells it ("1") or the answer plus one ("0")."""

    started: ClassVar[Counter] = Counter()

    def reset(self, prompt: str, target: str, plan: str = "1") -> None:
        turn = Oracle.started[prompt]
        Oracle.started[prompt] += 1
        self.answer = (int(target) + (plan[turn % len(plan)] != "1")) % 10
        self.calls = 0

    def lookup(self) -> str:
        """The answer to the question, written as a letter."""
        self.calls += 1
        return "=" + CODE[self.answer]


def looked_up(completions, environments, **columns):
    """1 when the rollout's environment was asked (a reward that reads the environment)."""
    return [float(env.calls > 0) for env in environments]


# A: always told the truth; B: the greedy rollout and the 2nd, 3rd samples are told a wrong answer;
# C ends in '!': the model guesses 'x' without calling
PROMPTS = [Prompt("1+1?", "2"), Prompt("2+3?", "5", metadata={"plan": "0100"}), Prompt("3+4!", "7")]


@pytest.fixture
def chat():
    Oracle.started.clear()
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok, scripted_model(tok)


def tool_sampler(tok, model, **kwargs):
    return ToolSampler(HFSampler(model, tok, max_completion_tokens=32), environment_factory=Oracle,
                       parser=CallsOnC(), max_turns=3, **kwargs)


def test_multi_turn_pass_at_k_avg_and_turns_equal_hand_values(chat):
    tok, model = chat
    report = evaluate(model, tok, PROMPTS, MathAccuracy(), k=3, sampler=tool_sampler(tok, model), seed=1,
                      progress=False)
    a, b, c = report.items
    # greedy: A told 2 -> "2"; B told 6 -> "6"; C never calls -> "x"
    assert [it.greedy_completion for it in report.items] == ["2", "6", "x"]
    assert [it.greedy_correct for it in report.items] == [True, False, False]
    assert a.sampled_completions == ("2", "2", "2") and b.sampled_completions == ("5", "6", "6")
    assert c.sampled_completions == ("x", "x", "x")
    assert (a.greedy_turns, a.greedy_tool_calls, c.greedy_turns, c.greedy_tool_calls) == (2, 1, 1, 0)
    assert b.sampled_turns == (2, 2, 2) and c.sampled_tool_calls == (0, 0, 0)
    assert [m["role"] for m in a.greedy_conversation] == ["assistant", "tool", "assistant"]
    assert a.greedy_conversation[1]["content"] == "=c"
    assert report.greedy_pass_at_1 == pytest.approx(1 / 3)  # A
    assert report.sampled_pass_at_1 == pytest.approx((3 / 3 + 1 / 3 + 0 / 3) / 3)  # 4/9
    assert report.pass_at_k == pytest.approx((1 + 1 + 0) / 3)  # n = k = 3: any correct sample
    assert report.maj_at_k == pytest.approx(1 / 3)  # A's "2"; B's majority "6" is wrong; C has no answer
    assert report.metrics["turns/greedy"] == pytest.approx(5 / 3)  # 2 + 2 + 1 turns
    assert report.metrics["tool_calls/greedy"] == pytest.approx(2 / 3)
    assert report.sampled_turns == pytest.approx(15 / 9) and report.sampled_tool_calls == pytest.approx(6 / 9)
    s = report.settings
    assert (s["sampler"], s["tools"], s["environment"], s["parser"], s["max_turns"], s["max_new_tokens"]) == \
        ("ToolSampler", ["lookup"], "Oracle", "CallsOnC", 3, 32)
    assert s["example_prompt"] == "tools: lookup\n1+1?"
    assert "turns" in report.table() and EvalReport.from_dict(report.to_dict()) == \
        EvalReport.from_dict(json.loads(json.dumps(report.to_dict())))


def test_without_the_tool_the_same_model_is_never_right(chat):
    tok, model = chat
    single = evaluate(model, tok, PROMPTS, MathAccuracy(), k=2, progress=False)
    assert [it.greedy_completion for it in single.items] == ["C", "C", "x"]
    assert single.metrics == {"pass@1": 0.0, "avg@2": 0.0, "pass@2": 0.0, "maj@2": 0.0}


def test_a_reward_reads_each_rollouts_environment(chat):
    tok, model = chat
    report = evaluate(model, tok, PROMPTS, FunctionReward(looked_up), k=2, sampler=tool_sampler(tok, model),
                      progress=False)
    assert report.metrics["pass@1"] == pytest.approx(2 / 3)  # A and B called, C did not
    assert report.metrics["avg@2"] == pytest.approx(2 / 3)
    assert [it.sampled_correct for it in report.items] == [(True, True), (True, True), (False, False)]


def test_greedy_is_temperature_zero_through_the_token_draw(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer, max_completion_tokens=6, return_logprobs=False)
    assert sampler.token_draw(0.0).greedy and not sampler.token_draw(0.5).greedy
    greedy = evaluate(tiny_model, tokenizer, PROMPTS, MathAccuracy(), max_new_tokens=6, progress=False)
    batch = sampler.sample(PROMPTS, group_size=2, temperature=0.0, draws=Draws(seed=3))
    # both draws of each prompt are the argmax path: evaluate's own greedy completions
    assert list(batch.texts) == [it.greedy_completion for it in greedy.items for _ in range(2)]
    via = evaluate(tiny_model, tokenizer, PROMPTS, MathAccuracy(), max_new_tokens=6, progress=False,
                   sampler=sampler)
    assert [it.greedy_completion for it in via.items] == [it.greedy_completion for it in greedy.items]


def test_the_single_turn_report_keeps_its_keys(chat):
    """The JSON of a report without tools has exactly the keys it had before multi-turn evaluation."""
    tok, model = chat
    data = evaluate(model, tok, PROMPTS, MathAccuracy(), k=2, progress=False).to_dict()
    assert list(data) == ["metrics", "num_prompts", "k", "greedy_pass_at_1", "sampled_pass_at_1", "pass_at_k",
                          "maj_at_k", "settings", "seconds", "items"]
    assert list(data["items"][0]) == [
        "question", "target", "greedy_completion", "greedy_answer", "greedy_score", "greedy_correct",
        "sampled_completions", "sampled_answers", "sampled_scores", "sampled_correct", "majority_answer",
        "majority_count", "majority_correct"]
    assert list(data["settings"]) == ["template", "example_prompt", "reward", "threshold", "greedy", "k",
                                      "temperature", "top_p", "top_k", "max_new_tokens", "batch_size", "seed",
                                      "num_prompts"]


def test_samples_do_not_depend_on_batch_size_and_leave_the_callers_rng_alone():
    from tests.test_tools import TEMPLATE as TURNS
    from tests.test_tools import EveryTurnCalls, echo, turn_taking_model

    tok = char_tokenizer()
    tok.chat_template = TURNS
    model = turn_taking_model(tok)
    sampler = ToolSampler(HFSampler(model, tok, max_completion_tokens=24), tools=[echo],
                          parser=EveryTurnCalls(), max_turns=2)
    prompts = [Prompt(f"{a}+{a}?", str(2 * a)) for a in range(3)]
    torch.manual_seed(0)
    one = evaluate(model, tok, prompts, MathAccuracy(), k=3, batch_size=1, sampler=sampler, progress=False)
    after = torch.rand(3)
    torch.manual_seed(0)
    many = evaluate(model, tok, prompts, MathAccuracy(), k=3, batch_size=64, sampler=sampler, progress=False)
    assert torch.equal(torch.rand(3), after)  # the same random state after either evaluation
    sampled = [it.sampled_completions for it in one.items]
    assert sampled == [it.sampled_completions for it in many.items]
    assert len({t for texts in sampled for t in texts}) > 3  # the rows did draw different tokens
    assert [it.sampled_turns for it in one.items] == [it.sampled_turns for it in many.items]
    # greedy rollouts (temperature 0) ignore the seed; sampled ones follow it
    other = evaluate(model, tok, prompts, MathAccuracy(), k=3, seed=5, sampler=sampler, progress=False)
    assert [it.greedy_conversation for it in other.items] == [it.greedy_conversation for it in one.items]
    assert [it.sampled_completions for it in other.items] != sampled


def test_held_out_eval_of_a_trainer_with_tools_is_multi_turn(chat, tmp_path):
    tok, model = chat
    trainer = GRPOTrainer(model, [MathAccuracy()], PROMPTS, tokenizer=tok, sampler=tool_sampler(tok, model),
                          config=GRPOConfig(prompts_per_step=1, group_size=2, max_completion_tokens=32,
                                            max_steps=1, output_dir=str(tmp_path), progress_bar=False),
                          memory=MemoryPlan(micro_batch_size=2))
    metrics: dict = {}
    HeldOutEval(PROMPTS, every_steps=1, k=3, temperature=1.0).on_step_end(
        trainer, trainer.state, trainer.control, metrics=metrics)
    assert metrics["eval/pass@1"] == pytest.approx(1 / 3) and metrics["eval/avg@3"] == pytest.approx(4 / 9)
    assert metrics["eval/pass@3"] == pytest.approx(2 / 3) and metrics["eval/maj@3"] == pytest.approx(1 / 3)
    assert metrics["eval/turns/greedy"] == pytest.approx(5 / 3)
    assert metrics["eval/tool_calls/sampled"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="k=0 must be an int >= 1"):
        HeldOutEval(PROMPTS, every_steps=1, k=0)


@pytest.fixture
def scripted_folder(tmp_path):
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    scripted_model(tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": p.content, "answer": p.target, **p.metadata}) + "\n"
                            for p in PROMPTS))
    return tmp_path / "model", data


def test_cli_eval_with_an_environment_reports_the_hand_values(scripted_folder, tmp_path, capsys):
    Oracle.started.clear()
    model, data = scripted_folder
    out = tmp_path / "report.json"
    assert main(["eval", "--model", str(model), "--dataset", "jsonl", "--data", str(data), "--k", "3",
                 "--environment", "tests.test_eval_tools:Oracle",
                 "--parser", "tests.test_eval_tools:CallsOnC", "--max-turns", "3", "--max-new-tokens", "32",
                 "--device", "cpu", "--no-progress-bar", "--output", str(out)]) == 0
    assert "greedy rollouts: 1.67 turns, 0.67 tool calls" in capsys.readouterr().out
    report = EvalReport.from_json(out)
    assert report.metrics == pytest.approx({"pass@1": 1 / 3, "avg@3": 4 / 9, "pass@3": 2 / 3, "maj@3": 1 / 3,
                                            "turns/greedy": 5 / 3, "tool_calls/greedy": 2 / 3,
                                            "turns/sampled": 5 / 3, "tool_calls/sampled": 2 / 3})
    assert report.settings["tools"] == ["lookup"] and report.settings["reward"] == "math_accuracy"
    # a reward function by import path reads the environments
    Oracle.started.clear()
    assert main(["eval", "--model", str(model), "--dataset", "jsonl", "--data", str(data), "--environment",
                 "tests.test_eval_tools:Oracle", "--parser", "tests.test_eval_tools:CallsOnC",
                 "--reward", "tests.test_eval_tools:looked_up", "--device", "cpu", "--no-progress-bar",
                 "--output", str(out)]) == 0
    assert EvalReport.from_json(out).metrics["pass@1"] == pytest.approx(2 / 3)


def lookup_table(key: str) -> str:
    """The target of a misspelled import path below.

    Args:
        key: any text.
    """
    return key


def test_cli_eval_refuses_tool_settings_without_tools_and_bad_import_paths(scripted_folder, tmp_path, capsys):
    model, data = scripted_folder
    common = ["eval", "--model", str(model), "--dataset", "jsonl", "--data", str(data), "--output",
              str(tmp_path / "r.json")]
    assert main([*common, "--max-turns", "2"]) == 2
    assert "--max-turns and --parser apply to multi-turn evaluation" in capsys.readouterr().err
    assert main([*common, "--tools", "tests.test_eval_tools:lookup_tabel"]) == 2
    assert "did you mean 'tests.test_eval_tools.lookup_table'" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
