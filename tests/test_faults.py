"""Faults a long run meets, driven end to end: each ends in a clear message, and nothing is lost or
written non-finite (docs/reliability.md lists them)."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan
from grpo_engine.cli import main
from grpo_engine.config import ConfigError
from grpo_engine.data import DataError, load_jsonl_prompts
from grpo_engine.guards import NonFiniteError
from grpo_engine.losses import CISPO, GSPO, ClippedSurrogate
from grpo_engine.ops.answers import MAX_CHARS, boxed_contents, final_answer
from grpo_engine.ops.verify_pool import VerifyPool
from grpo_engine.rewards import MathAccuracy, Reward, RewardError, WeightedSum
from grpo_engine.rewards.compose import RewardTimeout
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.spec import RunSpec, trusted
from grpo_engine.types import MicroBatch, Prompt
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare
from tests.tiny import char_tokenizer, tiny_llama


def trainer_for(tmp_path, rewards=None, max_steps=4, prompts=PROMPTS, **config):
    tok = char_tokenizer()
    settings = dict(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=max_steps,
                    learning_rate=1e-2, output_dir=str(tmp_path), progress_bar=False)
    return GRPOTrainer(tiny_llama(len(tok)), rewards or [DigitShare()], prompts,
                       GRPOConfig(**{**settings, **config}), MemoryPlan(micro_batch_size=4), tokenizer=tok,
                       template=TEMPLATE)


def weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def finite_files(folder):
    from safetensors.torch import load_file

    files = list(folder.rglob("*.safetensors"))
    return files and all(t.isfinite().all() for f in files for t in load_file(f).values())


# -- non-finite numbers ---------------------------------------------------------------------------


class Huge(Reward):
    """3e38 for completions with a digit: finite in float32, but a group's sum overflows."""

    def score(self, prompt, completion):
        return 3e38 if any(c.isdigit() for c in completion) else 0.0


def test_an_overflowing_reward_skips_the_step_and_stops_the_run_before_any_nan_is_written(tmp_path):
    trainer = trainer_for(tmp_path, rewards=[Huge()], save_every_steps=1)
    before = weights(trainer)
    with pytest.warns(UserWarning, match="skipped, weights unchanged: advantages are not finite"), \
            pytest.raises(NonFiniteError, match=r"3 steps in a row were skipped .* "
                                                 r"resume from the last checkpoint"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert trainer.state.skipped_steps == 3 and not (tmp_path / "final").exists()
    # the skipped steps' checkpoints hold the untouched weights
    for checkpoint in tmp_path.glob("checkpoint-*"):
        assert finite_files(checkpoint)


def test_a_nan_log_prob_skips_the_update_and_names_the_row(tmp_path, monkeypatch):
    import grpo_engine.gradients as trainer_module

    trainer = trainer_for(tmp_path, max_nonfinite_steps=2)
    real = trainer_module.completion_logprobs

    def poisoned(model, *args, **kwargs):  # the training pass's log-prob of one token of the first row is NaN
        out = real(model, *args, **kwargs)
        logprobs = out[0] if isinstance(out, tuple) else out
        if torch.is_grad_enabled():
            logprobs = logprobs.clone()
            logprobs[0, 0] = float("nan")
            return (logprobs, out[1]) if isinstance(out, tuple) else logprobs
        return out

    monkeypatch.setattr(trainer_module, "completion_logprobs", poisoned)
    before = weights(trainer)
    with pytest.warns(UserWarning, match=r"non-finite loss.*the log-probs of rows \[\d+(, \d+)?\] "
                                         r"are not finite"):
        metrics = trainer.step()  # the first row trained in each micro-batch of 4
    assert metrics["skipped_steps"] == 1.0 and "grad_norm" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert all(p.grad is None for p in trainer.model.parameters())  # no gradient left for a later step
    monkeypatch.setattr(trainer_module, "completion_logprobs", real)
    assert trainer.step()["skipped_steps"] == 1.0  # a finite step resets the count in a row


def test_non_finite_weights_are_never_saved(tmp_path):
    trainer = trainer_for(tmp_path)
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("inf")
    with pytest.raises(ValueError, match="refusing to save .* hold NaN or inf"):
        trainer.save(tmp_path / "checkpoint-1")
    assert not (tmp_path / "checkpoint-1").exists() and not list(tmp_path.glob(".*"))


def test_an_advantage_of_the_wrong_shape_is_refused(tmp_path):
    tok = char_tokenizer()
    trainer = GRPOTrainer(tiny_llama(len(tok)), [DigitShare()], PROMPTS,
                          GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=8,
                                     output_dir=str(tmp_path), progress_bar=False),
                          tokenizer=tok, template=TEMPLATE, advantage=lambda r, uncertainty=None: r.mean(1))
    with pytest.raises(ValueError, match=r"returned advantages of shape \(2,\); an AdvantageFn maps rewards "
                                         r"\[B, G\]=\(2, 4\) to the same shape"):
        trainer.step()


@pytest.mark.parametrize("loss", [ClippedSurrogate(0.2, 0.28, aggregation="token"), CISPO(),
                                  GSPO(level="token")],
                         ids=lambda f: type(f).__name__)
def test_a_huge_log_ratio_gives_the_exact_gradient_not_nan(loss):
    """exp(90) overflows float32. ClippedSurrogate: the ratio of token 1 is clipped (A > 0), so its
    gradient is 0; token 2 is on-policy: -A / 2 tokens = -0.5. Every loss stays finite."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool), advantages=torch.tensor([1.0]),
                       old_logprobs=torch.tensor([[-91.0, -2.0]]))
    out = loss(logprobs, batch, num_valid_tokens=2, num_sequences=1)
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and logprobs.grad.isfinite().all()
    if isinstance(loss, ClippedSurrogate):
        assert logprobs.grad.tolist() == [[0.0, -0.5]]


# -- rewards that hang, crash or run away -------------------------------------------------------------


class Stuck(Reward):
    """Waits on an event that the test sets at its end (a reward that never returns)."""

    def __init__(self, release):
        super().__init__()
        self.release = release

    def score(self, prompt, completion):
        self.release.wait(30)
        return 1.0


def test_a_hanging_reward_times_out_with_a_clear_error_or_scores_zero(tmp_path):
    release = threading.Event()
    try:
        trainer = trainer_for(tmp_path, rewards=[DigitShare(), Stuck(release)], reward_timeout_s=0.3)
        before = weights(trainer)
        with pytest.raises(RewardTimeout, match=r"reward 'stuck' did not return within 0.3 s on a batch of 8 "
                                                r"completions.*raise GRPOConfig.reward_timeout_s, or set "
                                                r"on_reward_error='zero'"):
            trainer.step()
        assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
        zero = trainer_for(tmp_path / "zero", rewards=[DigitShare(), Stuck(release)], reward_timeout_s=0.3,
                           on_reward_error="zero")
        metrics = zero.step()
        assert metrics["reward/stuck/errors"] == 8 and metrics["reward/stuck/mean"] == 0.0
        assert metrics["reward/digit_share/errors"] == 0
        assert metrics["reward/mean"] == metrics["reward/digit_share/mean"]
    finally:
        release.set()


class FailsOn(Reward):
    """Raises on the completions in ``bad``, else DigitShare's score."""

    def __init__(self, bad):
        super().__init__()
        self.bad = set(bad)

    def score(self, prompt, completion):
        if completion in self.bad:
            raise KeyError("boom")
        return DigitShare().score(prompt, completion)


def test_one_failing_sample_is_scored_zero_and_counted_the_others_keep_their_scores(tmp_path):
    trainer = trainer_for(tmp_path)
    batch = trainer.sampler.sample(PROMPTS[:2], group_size=4)
    bad = batch.texts[1]
    expected = [0.0 if t == bad else DigitShare().score(None, t) for t in batch.texts]
    with pytest.raises(RewardError, match=r"reward 'fails_on' .* raised KeyError on sample 1"):
        WeightedSum([FailsOn({bad})])(batch)
    out = WeightedSum([FailsOn({bad})], on_error="zero")(batch)
    assert out.errors == {"fails_on": batch.texts.count(bad)}
    assert out.breakdown["fails_on"].flatten().tolist() == pytest.approx(expected, abs=0, rel=1e-6)


def test_a_runaway_parse_ends_in_its_worker_whose_memory_is_capped():
    """``2^2^2^2^2^2`` ran for minutes in a thread (math-verify's alarm off) and swelled to 3.7 GB; in a
    worker the alarm works, the address space is capped at 2 GiB, and the next pair is verified."""
    pool = VerifyPool(workers=1, timeout_s=8)
    try:
        (runaway, _), (equal, ok) = pool.verify([("1", "2^2^2^2^2^2"), ("0.5", r"\frac{1}{2}")])
        assert runaway is not True and (equal, ok) == (True, None)
        assert pool.verify([("", "1")]) == [(None, "gold")]
        limits = Path(f"/proc/{pool._idle[0].pid}/limits")
        if limits.is_file():
            line = next(line for line in limits.read_text().splitlines()
                        if line.startswith("Max address space"))
            assert line.split()[3] == str(2 << 30)
    finally:
        pool.close()


HANGING_WORKER = """
import json, sys, time
for line in sys.stdin:
    task = json.loads(line)
    if task["answer"] == "hang":
        time.sleep(600)
    print(json.dumps({"id": task["id"], "equal": task["answer"] == task["gold"], "error": None}), flush=True)
"""


def test_a_pair_past_the_timeout_has_its_worker_killed_and_replaced(tmp_path, monkeypatch):
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(HANGING_WORKER)
    started = []

    def start(self):
        started.append(subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, bufsize=1))
        return started[-1]

    monkeypatch.setattr(VerifyPool, "_start", start)
    pool = VerifyPool(workers=2, timeout_s=1)
    try:
        t0 = time.perf_counter()
        results = pool.verify([("1", "hang"), ("1", "1"), ("2", "3"), ("4", "4")])
        assert results == [(None, "timed out after 1 s"), (True, None), (False, None), (True, None)]
        # the hanging worker was killed
        assert time.perf_counter() - t0 < 10 and started[0].poll() is not None
        assert pool.verify([("5", "5")]) == [(True, None)]
    finally:
        pool.close()


def test_answer_extraction_is_linear_and_capped():
    opened = "\\boxed{" * 6000  # 42 kB of unclosed boxes: quadratic extraction took 25 s
    start = time.perf_counter()
    assert final_answer(opened + "42}") == "42"
    assert final_answer(opened) is None
    assert boxed_contents("\\boxed{1} \\boxed{\\frac{2}{3}}") == ["1", "\\frac{2}{3}"]
    assert final_answer("x" * 100_000 + "<answer>7</answer>") == "7"  # only the last MAX_CHARS are read
    assert final_answer("<answer>7</answer>" + "x" * MAX_CHARS) is None
    assert time.perf_counter() - start < 5  # was 25 s; linear is milliseconds


def test_math_verify_log_lines_are_cut():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("math_verify.parser")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("Timeout during parsing: %s", "9" * 100_000)
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1 and len(records[0]) <= 310 and records[0].endswith("[cut]")


# -- data checked when the trainer is built -------------------------------------------------------------


def test_every_bad_record_is_reported_at_once_with_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "1+1?", "answer": "2"}\n'
                     b'{"question": "caf\xe9?", "answer": "3"}\n'  # latin-1, not UTF-8
                     b'{"question": "2+2?", "answer": ""}\n'
                     b'{"question": "3+3?", "answer": {"a": 1}}\n'
                     b'{"question": "4+4?"}\n')
    with pytest.raises(DataError) as info:
        load_jsonl_prompts(path)
    text = str(info.value)
    assert text.startswith(f"{path}: 4 bad record(s)")
    assert f"{path}:2: not UTF-8 (byte 0xe9 at column 18); save the file as UTF-8" in text
    assert f"{path}:3: 'answer' is empty" in text
    assert f"{path}:4: 'answer' must be a string or a number, got dict" in text
    assert f"{path}:5: no 'answer' field" in text


def test_targets_the_accuracy_reward_cannot_score_stop_the_trainer_before_any_step(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"{a}+1?", "answer": ans}) + "\n"
                            for a, ans in enumerate(["2", "hello world", "\\frac{1}{2}", "3", "$$"])))
    prompts = load_jsonl_prompts(path)
    with pytest.raises(DataError) as info:
        trainer_for(tmp_path, rewards=[MathAccuracy()], prompts=prompts)
    text = str(info.value)
    assert text.startswith("training prompts: 2 bad record(s); fix these records")
    assert f"{path}:2: math_accuracy: target 'hello world' is words, not a math answer" in text
    assert f"{path}:5: math_accuracy: math-verify cannot parse target '$$'" in text
    assert not (tmp_path / "metrics.jsonl").exists()


def test_duplicates_are_counted_and_named(tmp_path):
    prompts = [*PROMPTS, PROMPTS[3], PROMPTS[3], PROMPTS[5]]
    with pytest.warns(UserWarning, match=r"3 of 21 training prompts repeat an earlier one .* first: prompt "
                                         r"'4\+2=' repeats prompt '4\+2='"):
        trainer = trainer_for(tmp_path, prompts=prompts)
    assert len(trainer.prompts.prompts) == 21  # kept


LONG = Prompt("The start. " + "x" * 100 + " The end?", target="1")


def test_an_overlong_prompt_loses_the_middle_of_its_question_not_the_chat_head(tmp_path):
    tok = char_tokenizer()
    head, tail = "<user>", "\n<assistant>"  # the test tokenizer's chat template around the question
    sampler = HFSampler(tiny_llama(len(tok)), tok, max_prompt_tokens=len(head) + len(tail) + 20,
                        max_completion_tokens=2)
    whole = sampler.prompt_tokens(LONG)
    assert tok.decode(whole) == head + LONG.question + tail
    assert tok.decode(sampler.truncated(LONG, whole)) == head + "The start." + "x The end?" + tail
    with pytest.warns(UserWarning, match=r"1 prompt\(s\) of a batch are longer than max_prompt_tokens=38"):
        batch = sampler.sample([LONG, PROMPTS[0]], group_size=2)
    assert batch.metrics["prompts/truncated"] == 1.0
    assert tok.decode(batch.prompt_ids[0][batch.prompt_mask[0]]) == head + "The start.x The end?" + tail


def test_overlong_prompts_can_be_dropped_or_refused(tmp_path):
    tok = char_tokenizer()
    settings = dict(prompts_per_step=2, group_size=2, max_completion_tokens=4, max_prompt_tokens=38,
                    progress_bar=False)

    def build(policy):
        return GRPOTrainer(tiny_llama(len(tok)), [DigitShare()], [*PROMPTS, LONG],
                           GRPOConfig(overlong_prompts=policy, output_dir=str(tmp_path / policy), **settings),
                           tokenizer=tok)

    with pytest.warns(UserWarning, match=r"dropped 1 of 19 training prompts longer than max_prompt_tokens=38 "
                                         r"\(overlong_prompts='drop'; first: prompt 'The start\. x+'\.\.\., "
                                         r"138 tokens\)"):
        assert LONG not in build("drop").prompts.prompts
    with pytest.raises(DataError, match=r"1 bad record\(s\); overlong_prompts='error': "
                                        r"raise max_prompt_tokens.*\n"
                                        r"  prompt 'The start\. x+'\.\.\.: 138 tokens > "
                                        r"max_prompt_tokens=38"):
        build("error")


# -- trust ------------------------------------------------------------------------------------------------


def test_a_run_file_may_only_import_grpo_engine_and_the_modules_it_lists():
    text = "model: m\ntrain_prompts: {function: grpo_engine.data.load_gsm8k}\nrewards: [{class: os.system}]\n"
    with pytest.raises(ConfigError, match=r"\['os.system'\] are outside grpo_engine and not under a module "
                                              r"listed in 'imports:'.*imports: \[os\]"):
        RunSpec.from_yaml(text)
    assert RunSpec.from_yaml(text + "imports: [os]\n").rewards[0].target == "os.system"
    assert (not trusted("grpo_engine_evil.x", []) and not trusted("osx.y", ["os"])
            and trusted("os.path.join", ["os"]))


# -- the command line: refusals before anything is written, resume ------------------------------------------


def test_cli_refuses_a_used_output_dir_without_touching_it_and_resumes_with_named_changes(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tok = char_tokenizer()
    tiny_llama(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a}+{a}", "a": str(2 * a)}) + "\n" for a in range(10, 20)))
    out = tmp_path / "run"

    def run_file(max_steps, reward="grpo_engine.rewards.MathAccuracy"):
        path = tmp_path / f"run-{max_steps}.yaml"
        path.write_text(f"""
model: {model_dir}
train_prompts: {{function: grpo_engine.data.load_jsonl_prompts, path: {data}, question_field: q,
                answer_field: a}}
rewards: [{{class: {reward}}}, {{class: tests.test_trainer.DigitShare, weight: 0.5}}]
template: {{class: grpo_engine.data.PlainTemplate, format: "{{question}}="}}
config: {{prompts_per_step: 2, group_size: 3, max_completion_tokens: 6, max_steps: {max_steps},
          output_dir: {out}, progress_bar: false, save_every_steps: 1}}
memory: {{lora: {{r: 2, alpha: 4}}, micro_batch_size: 4}}
imports: [tests]
""")
        return str(path)

    assert main(["train", run_file(2)]) == 0
    saved = (out / "run.yaml").read_bytes()
    capsys.readouterr()
    assert main(["train", run_file(3)]) == 2
    assert "already holds a run (metrics.jsonl); continue it with --resume" in capsys.readouterr().err
    assert ((out / "run.yaml").read_bytes() == saved
            and len((out / "metrics.jsonl").read_text().splitlines()) == 2)
    assert main(["train", run_file(3), "--resume"]) == 2
    assert "config.max_steps was 2, now 3: allow it with" in capsys.readouterr().err
    assert main(["train", run_file(3, "grpo_engine.rewards.BoxedFormat"), "--resume"]) == 2
    assert "rewards differ from its run.yaml" in capsys.readouterr().err
    assert (out / "run.yaml").read_bytes() == saved
    assert main(["train", run_file(3), "--resume", "--allow-change", "config.max_steps"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert [json.loads(line)["step"]
            for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert RunSpec.from_yaml(out / "run.yaml").config.max_steps == 3
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left
