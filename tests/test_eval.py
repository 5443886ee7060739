"""Evaluation: pass@k by hand and by enumeration, majority vote, evaluate() on scripted and tiny models,
the report's JSON, the ``grpo-engine eval`` command and the trainer's periodic evaluation."""

import json
import math
from collections import Counter
from itertools import combinations
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan
from grpo_engine.callbacks import Callback, HeldOutEval
from grpo_engine.cli import main
from grpo_engine.eval import EvalReport, evaluate, final_answer, greedy_accuracy, majority_vote, pass_at_k
from grpo_engine.rewards import MathAccuracy, Reward
from grpo_engine.types import Prompt
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare
from tests.tiny import char_tokenizer, tiny_llama

# -- pass@k ---------------------------------------------------------------------------------------


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)  # pass@1 is c/n
    assert pass_at_k(4, 1, 4) == 1.0  # n = k: 1 as soon as one sample is correct
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(10, 10, 3) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # n - c = 2 < k: every 3-subset holds a correct one


def test_pass_at_k_equals_enumeration_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([True] * c + [False] * (n - c), k))
                want = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    want = 1 - math.comb(800, 100) / math.comb(1000, 100)  # exact big integers, then one division
    assert pass_at_k(1000, 200, 100) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("n, c, k, match", [(3, 1, 4, "k=4 must be in"), (3, 4, 1, "c=4 must be in"),
                                            (3, -1, 1, "c=-1"), (0, 0, 1, "n=0"), (3, 1, 0, "k=0"),
                                            (3, 1.0, 1, "must be an int")])
def test_pass_at_k_rejects_impossible_counts(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


# -- majority vote ---------------------------------------------------------------------------------


def test_majority_vote_clusters_equivalent_forms():
    assert majority_vote(["3", "1/2", "0.5", r"\frac{1}{2}", "3"]) == ("1/2", 3)
    assert majority_vote(["1,000", "1000", "999"]) == ("1,000", 2)


def test_unanswered_never_wins_and_ties_go_to_the_first():
    assert majority_vote([None, None, None, "4"]) == ("4", 1)
    assert majority_vote([None, None]) == (None, 0)
    assert majority_vote([]) == (None, 0)
    assert majority_vote(["4", "3", "3", "4"]) == ("4", 2)  # 2-2 tie: "4" came first
    assert majority_vote(["x?", "x?", "7"]) == ("x?", 2)  # unparseable, but the same string
    assert majority_vote(["A", "b", "a"], equal=lambda x, y: x.lower() == y.lower()) == ("A", 2)


def test_final_answer_follows_math_accuracy():
    assert final_answer(r"so 3, i.e. \boxed{4}") == "4"
    assert final_answer("<answer> 12 </answer> 13") == "12"
    assert final_answer("<answer> </answer> 13") is None  # a blank tag is no answer, as MathAccuracy says
    assert final_answer("no digits here") is None


# -- evaluate() on a scripted model: every number by hand -----------------------------------------


class Scripted(nn.Module):
    """generate() returns scripted completions: greedy[q], or samples[q][j] for the j-th row of q in a
    call."""

    def __init__(self, tokenizer, greedy, samples):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))
        self.generation_config = SimpleNamespace(eos_token_id=1)
        self.tokenizer, self.greedy, self.samples = tokenizer, greedy, samples

    def generate(self, input_ids, attention_mask, generation_config=None, do_sample=False, **_):
        sampled = generation_config.do_sample if generation_config is not None else do_sample
        seen, rows = Counter(), []
        for ids, mask in zip(input_ids, attention_mask):
            question = self.tokenizer.decode(ids[mask.bool()])
            text = self.samples[question][seen[question]] if sampled else self.greedy[question]
            seen[question] += 1
            rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [1])
        out = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, :len(row)] = torch.tensor(row)
        return torch.cat([input_ids, out], dim=1)


SCRIPT = {  # question: (target, greedy, 4 samples)
    "half?": ("0.5", "1/2", ["<answer>1/2</answer>", "it is 0.5", r"\boxed{\frac{1}{2}}", "7"]),
    "two?": ("2", "3", ["3", "3", "2", "no idea"]),
    "ten?": ("10", "10", ["x", "y", "z", "w"]),
    "four?": ("4", "<answer></answer> 4", ["5", "4", "5", "4"]),
}


def scripted_report(batch_size=8, **kwargs):
    tok = char_tokenizer()
    model = Scripted(tok, {q: g for q, (_, g, _) in SCRIPT.items()},
                     {q: s for q, (_, _, s) in SCRIPT.items()})
    prompts = [Prompt(q, target) for q, (target, _, _) in SCRIPT.items()]
    return evaluate(model, tok, prompts, MathAccuracy(), template=TEMPLATE, k=4, max_new_tokens=32,
                    batch_size=batch_size, progress=False, **kwargs)


@pytest.mark.parametrize("batch_size", [1, 6, 64])
def test_scripted_metrics_by_hand(batch_size):
    report = scripted_report(batch_size)
    # greedy: right, wrong, right, blank tag = no answer -> 2/4
    # samples correct: 3, 1, 0, 2 of 4 -> avg@4 = 6/16; at least one right: 3 of 4 prompts
    # majorities: "1/2" x3 (right), "3" x2 (wrong), none (wrong), "5"/"4" tie -> "5" (wrong) -> 1/4
    assert report.metrics == {"pass@1": 0.5, "avg@4": 0.375, "pass@4": 0.75, "maj@4": 0.25}
    half, two, ten, four = report.items
    assert half.sampled_answers == ("1/2", "0.5", r"\frac{1}{2}", "7")
    assert half.sampled_correct == (True, True, True, False)
    assert (half.majority_answer, half.majority_count, half.majority_correct) == ("1/2", 3, True)
    assert (two.majority_answer, two.majority_count, two.majority_correct) == ("3", 2, False)
    assert (ten.greedy_answer, ten.greedy_correct) == ("10", True)
    assert (ten.majority_answer, ten.majority_count, ten.majority_correct) == (None, 0, False)
    assert (four.greedy_answer, four.greedy_score, four.greedy_correct) == (None, 0.0, False)
    assert (four.majority_answer, four.majority_correct) == ("5", False)
    assert two.sampled_completions[3] == "no idea" and two.sampled_answers[3] is None


def test_report_records_settings_and_prints_a_table():
    report = scripted_report(seed=7, temperature=0.6)
    s = report.settings
    assert (s["k"], s["seed"], s["temperature"], s["max_new_tokens"], s["greedy"]) == (4, 7, 0.6, 32, True)
    assert s["template"] == "PlainTemplate(format='{question}')" and s["example_prompt"] == "half?"
    assert s["reward"] == "math_accuracy" and s["threshold"] == 1.0 and s["num_prompts"] == 4
    table = report.table()
    rows = [line.split()[:3] for line in table.splitlines()]
    assert ["pass@1", "0.5000", "2/4"] in rows and ["avg@4", "0.3750", "6/16"] in rows
    assert ["pass@4", "0.7500", "3/4"] in rows and ["maj@4", "0.2500", "1/4"] in rows
    assert "one prompt = 25.00 points" in table


def test_greedy_only_and_sampled_only_report_what_ran():
    tok = char_tokenizer()
    model = Scripted(tok, {"two?": "2"}, {"two?": ["2"]})
    only_greedy = evaluate(model, tok, [Prompt("two?", "2")], MathAccuracy(), template=TEMPLATE,
                           progress=False)
    assert only_greedy.metrics == {"pass@1": 1.0} and only_greedy.items[0].sampled_completions == ()
    assert only_greedy.settings["temperature"] is None and "greedy" in only_greedy.table()
    sampled = evaluate(model, tok, [Prompt("two?", "2")], MathAccuracy(), template=TEMPLATE, greedy=False,
                       progress=False)
    assert sampled.metrics == {"avg@1": 1.0} and sampled.items[0].greedy_completion is None


def test_evaluate_rejects_bad_settings(tiny_model, tokenizer):
    reward = MathAccuracy()
    with pytest.raises(ValueError, match="no prompts"):
        evaluate(tiny_model, tokenizer, [], reward)
    with pytest.raises(ValueError, match="k=0 must be an int >= 1"):
        evaluate(tiny_model, tokenizer, PROMPTS, reward, k=0)
    with pytest.raises(ValueError, match="temperature=0"):
        evaluate(tiny_model, tokenizer, PROMPTS, reward, k=2, temperature=0)


# -- evaluate() on a tiny random model -------------------------------------------------------------


class ExactMatch(Reward):
    def score(self, prompt, completion):
        return 1.0 if completion == prompt.target else 0.0


def half_right(model, tokenizer, prompts, **kwargs):
    """The prompts with targets set so that exactly the even-indexed greedy completions are right."""
    texts = greedy_accuracy(model, tokenizer, prompts, ExactMatch(), template=TEMPLATE, **kwargs).completions
    return [Prompt(p.content, t if i % 2 == 0 else t + "#") for i, (p, t) in enumerate(zip(prompts, texts))]


def test_greedy_pass_at_1_equals_greedy_accuracy(tiny_model, tokenizer):
    prompts = half_right(tiny_model, tokenizer, PROMPTS[:8], max_new_tokens=6, batch_size=4)
    report = evaluate(tiny_model, tokenizer, prompts, ExactMatch(), template=TEMPLATE, max_new_tokens=6,
                      batch_size=4, progress=False)
    old = greedy_accuracy(tiny_model, tokenizer, prompts, ExactMatch(), template=TEMPLATE, max_new_tokens=6,
                          batch_size=4)
    assert report.greedy_pass_at_1 == old.accuracy == 0.5
    assert tuple(it.greedy_completion for it in report.items) == old.completions


def test_sampling_is_seeded_and_leaves_the_callers_rng_alone(tiny_model, tokenizer):
    def run(seed):
        return evaluate(tiny_model, tokenizer, PROMPTS[:2], DigitShare(), template=TEMPLATE, k=3,
                        max_new_tokens=4, batch_size=6, seed=seed, threshold=0.5, greedy=False,
                        progress=False)

    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, other = run(0), run(0), run(1)
    assert torch.equal(torch.get_rng_state(), state)
    assert a.items == b.items and a.metrics == b.metrics
    assert [it.sampled_completions for it in a.items] != [it.sampled_completions for it in other.items]
    for it in a.items:  # the aggregates are the items' numbers
        assert (len(it.sampled_completions) == 3
                and it.sampled_correct == tuple(s >= 0.5 for s in it.sampled_scores))
    assert a.sampled_pass_at_1 == pytest.approx(sum(sum(it.sampled_correct) for it in a.items) / 6)
    assert a.pass_at_k == pytest.approx(sum(any(it.sampled_correct) for it in a.items) / 2)
    assert tiny_model.training is False


def test_report_json_round_trip(tiny_model, tokenizer, tmp_path):
    report = evaluate(tiny_model, tokenizer, PROMPTS[:3], DigitShare(), template=TEMPLATE, k=2,
                      max_new_tokens=4, threshold=0.5, progress=False)
    path = report.to_json(tmp_path / "out" / "report.json")
    assert EvalReport.from_json(path) == report
    data = json.loads(path.read_text())
    assert set(data["metrics"]) == {"pass@1", "avg@2", "pass@2", "maj@2"} and data["settings"]["k"] == 2
    assert (data["items"][0]["question"] == PROMPTS[0].question
            and data["items"][0]["target"] == PROMPTS[0].target)
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # no temporary file left behind


# -- grpo-engine eval ------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    tokenizer = char_tokenizer()
    tiny_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_cli_eval_writes_a_report(model_dir, tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a}+{a}", "a": str(2 * a)}) + "\n" for a in range(10, 20)))
    out = tmp_path / "report.json"
    assert main(["eval", "--model", str(model_dir), "--dataset", "jsonl", "--data", str(data),
                 "--question-field", "q", "--answer-field", "a", "--limit", "3", "--k", "2",
                 "--max-new-tokens", "4", "--seed", "5", "--template-instruction", " =", "--device", "cpu",
                 "--no-progress-bar", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "maj@2" in printed and f"report written to {out}" in printed
    report = EvalReport.from_json(out)
    assert report.num_prompts == 3 and [it.target for it in report.items] == ["20", "22", "24"]
    s = report.settings
    assert (s["model"], s["dataset"], s["limit"], s["k"], s["seed"], s["device"]) == \
        (str(model_dir), "jsonl", 3, 2, 5, "cpu")
    assert s["example_prompt"] == "<user>10+10 =\n<assistant>"  # the chat template, with the instruction


def test_cli_eval_applies_a_peft_adapter(model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    tok = char_tokenizer()
    policy = get_peft_model(tiny_llama(len(tok)),
                            LoraConfig(r=2, target_modules=["q_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 2.0)  # lora_B starts at 0 (identity); make the adapter matter
    policy.save_pretrained(tmp_path / "adapter")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+1",
                                        "answer": f"{a}+1=<<{a}+1={a + 1}>>{a + 1}\n#### "
                                        f"{a + 1}"}) + "\n" for a in range(5)))
    common = ["eval", "--model", str(model_dir), "--dataset", "gsm8k", "--data", str(data),
              "--max-new-tokens", "4", "--limit", "3", "--device", "cpu", "--no-progress-bar"]
    assert main([*common, "--adapter", str(tmp_path / "adapter"), "--output", str(tmp_path / "a.json")]) == 0
    assert main([*common, "--output", str(tmp_path / "b.json")]) == 0
    with_adapter, base = EvalReport.from_json(tmp_path / "a.json"), EvalReport.from_json(tmp_path / "b.json")
    assert [it.target for it in base.items] == ["1", "2", "3"]
    want = evaluate(policy.eval(), tok, [Prompt(f"{a}+1", str(a + 1)) for a in range(3)], MathAccuracy(),
                    max_new_tokens=4, progress=False)
    got = [it.greedy_completion for it in with_adapter.items]
    assert got == [it.greedy_completion for it in want.items]
    assert got != [it.greedy_completion for it in base.items]


def test_cli_eval_data_errors_exit_2(model_dir, tmp_path, capsys, monkeypatch):
    from grpo_engine.data import DataError, loaders

    calls = []

    def offline(source, split):
        calls.append((source, split))
        raise DataError("could not load GSM8K split 'test' from the hub (offline); "
                        "when offline, pass the local file")

    monkeypatch.setattr(loaders, "_hub_records", offline)
    common = ["--model", str(model_dir), "--output", str(tmp_path / "r.json")]
    assert main(["eval", "--dataset", "gsm8k", *common]) == 2
    assert calls == [("openai/gsm8k:main/test", "test")]
    assert "error: could not load GSM8K split 'test' from the hub" in capsys.readouterr().err
    assert main(["eval", "--dataset", "math500", *common]) == 2
    assert "--dataset math500 needs --data PATH" in capsys.readouterr().err
    assert main(["eval", "--dataset", "jsonl", "--data", str(tmp_path / "missing.jsonl"), *common]) == 2
    assert "data file not found" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


# -- the trainer's periodic evaluation --------------------------------------------------------------


def make_trainer(tmp_path, callbacks=(), **config):
    tok = char_tokenizer()
    defaults = dict(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=4,
                    learning_rate=1e-2, output_dir=str(tmp_path), progress_bar=False)
    return GRPOTrainer(tiny_llama(len(tok)), [DigitShare()], PROMPTS, tokenizer=tok, template=TEMPLATE,
                       config=GRPOConfig(**{**defaults, **config}), memory=MemoryPlan(micro_batch_size=8),
                       callbacks=callbacks)


def test_trainer_evaluate_uses_its_template_and_token_limit(tmp_path):
    trainer = make_trainer(tmp_path)
    prompts = half_right(trainer.model, trainer.tokenizer, PROMPTS[:6], max_new_tokens=5)
    # another template or limit would miss the targets
    assert trainer.evaluate(prompts, reward=ExactMatch(), max_new_tokens=5) == {"eval/pass@1": 0.5}
    calls = []
    real = trainer.evaluate
    trainer.evaluate = lambda prompts, **kw: calls.append(kw) or real(prompts, **kw)
    HeldOutEval(prompts, every_steps=1).on_step_end(trainer, trainer.state, trainer.control, metrics={})
    assert calls == [{"reward": None, "max_new_tokens": None}]  # the trainer's defaults: its first reward, C
    assert real(prompts, max_new_tokens=5) == real(prompts, reward=trainer.rewards.rewards[0],
                                                   max_new_tokens=5)


def test_trainer_logs_eval_every_n_steps(tmp_path):
    prompts = PROMPTS[:4]
    trainer = make_trainer(tmp_path, callbacks=[HeldOutEval(prompts, every_steps=2, reward=DigitShare())])
    seen = []
    for _ in range(3):
        metrics = trainer.step()
        seen.append("eval/pass@1" in metrics)
        if "eval/pass@1" in metrics:  # the policy after this step's update
            want = greedy_accuracy(trainer.model, trainer.tokenizer, prompts, DigitShare(), template=TEMPLATE,
                                   max_new_tokens=8).accuracy
            assert metrics["eval/pass@1"] == want and metrics["time/eval_s"] > 0
    assert seen == [False, True, False]


def test_eval_lines_reach_metrics_jsonl_and_do_not_change_training(tmp_path):
    # build and train one after the other: a trainer seeds the global RNG when it is built
    history = make_trainer(tmp_path / "a", callbacks=[HeldOutEval(PROMPTS[:2], every_steps=1)],
                           log_every_steps=2, max_steps=3).train()
    reference = make_trainer(tmp_path / "b", log_every_steps=2, max_steps=3).train()
    lines = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]  # eval steps are written even off log_every_steps
    assert all("eval/pass@1" in line for line in lines)
    for h, r in zip(history, reference, strict=True):
        assert h["reward/mean"] == r["reward/mean"] and h["grad_norm"] == r["grad_norm"]


def test_a_callback_can_ask_for_an_evaluation_and_the_settings_are_checked(tmp_path):
    class AskOnce(Callback):
        def on_step_end(self, trainer, state, control, *, metrics):
            control.should_evaluate = state.step == 1

    trainer = make_trainer(tmp_path, callbacks=[AskOnce(), HeldOutEval(PROMPTS[:2], every_steps=10)])
    assert "eval/pass@1" in trainer.step() and "eval/pass@1" not in trainer.step()
    with pytest.raises(ValueError, match="every_steps=0 must be an int >= 1"):
        HeldOutEval(PROMPTS, every_steps=0)
    with pytest.raises(ValueError, match="HeldOutEval got no prompts"):
        HeldOutEval([], every_steps=1)
