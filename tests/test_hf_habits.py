"""The habits users bring from transformers, peft, datasets and TRL: datasets as prompts, plain reward
functions with their columns, peft configs and models, TensorBoard, merged export, and TRL's script
from docs/from_trl.md running as written."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
from grpo_engine.cli import example_config, main
from grpo_engine.config import ConfigError
from grpo_engine.data import DataError, to_prompts
from grpo_engine.rewards import FunctionReward, RewardError, WeightedSum
from grpo_engine.spec import RunSpec
from grpo_engine.types import Prompt
from tests.test_rewards import make_batch
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare
from tests.tiny import char_tokenizer, tiny_llama

DOCS = Path(__file__).resolve().parents[1] / "docs"
SMALL = dict(prompts_per_step=2, group_size=2, max_completion_tokens=4, max_steps=1, progress_bar=False)


# -- prompts from anywhere -----------------------------------------------------------------------------------


def test_a_dataset_with_extra_columns_reaches_a_plain_reward_function(tmp_path):
    data = Dataset.from_dict({"prompt": ["3+4=", "5+6=", "7+1="], "answer": ["7", "11", "8"],
                              "level": [1, 2, 3]})
    seen = []

    def exact(prompts, completions, answer, level, target, **kwargs):
        seen.append((list(prompts), list(answer), list(level), list(target), sorted(kwargs)))
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    tok = char_tokenizer()
    trainer = GRPOTrainer(tiny_llama(len(tok)), exact, data, GRPOConfig(output_dir=str(tmp_path), **SMALL),
                          tokenizer=tok, template=TEMPLATE)
    metrics = trainer.step()
    prompts, answers, levels, targets, others = seen[0]
    assert len(prompts) == 4 and prompts[0] == prompts[1]  # one per completion: G = 2 per prompt
    by_prompt = {"3+4=": ("7", 1), "5+6=": ("11", 2), "7+1=": ("8", 3)}
    assert [(a, lv) for a, lv in zip(answers, levels)] == [by_prompt[p] for p in prompts]
    assert targets == answers
    assert others == ["completion_ids", "index", "log_extra", "log_metric", "source", "trainer_state"]
    assert "reward/exact/mean" in metrics


def test_to_prompts_reads_trl_conversations_maps_columns_and_reports_every_bad_row():
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
             "solution": 2}]
    p = to_prompts(rows, answer="solution")[0]
    assert p.question == "1+1?" and p.content[0]["role"] == "system" and p.target == "2"
    assert p.metadata == {"solution": 2, "source": "data", "index": 0}
    assert to_prompts([{"q": "2+2?", "a": 4}], question="q", answer="a")[0].target == "4"
    assert to_prompts([Prompt("x")]) == [Prompt("x")]
    streamed = Dataset.from_dict({"question": ["a?", "b?"], "target": [1, 2]}).to_iterable_dataset()
    assert [(p.question, p.target) for p in to_prompts(streamed)] == [("a?", "1"), ("b?", "2")]
    with pytest.raises(DataError) as info:
        to_prompts([{"prompt": "ok", "answer": "1"}, {"prompt": "", "answer": "1"},
                    {"prompt": "q", "answer": None}, {"prompt": "q", "answer": {"a": 1}}, "text"])
    text = str(info.value)
    assert text.startswith("data: 4 bad record(s)")
    for line in ["data[1]: 'prompt' is empty", "data[2]: 'answer' is missing or null",
                 "data[3]: 'answer' must be a string or a number, got dict", "data[4]: expected a row"]:
        assert line in text
    with pytest.raises(DataError, match=r"no question column among \['text'\]; pass question="):
        to_prompts([{"text": "hi"}])
    with pytest.raises(DataError, match=r"a dict of splits \(\['train'\]\); pass one split"):
        to_prompts({"train": Dataset.from_dict({"prompt": ["a"]})})


# -- plain reward functions ----------------------------------------------------------------------------------


def test_none_leaves_a_sample_out_of_the_weighted_sum_and_is_counted():
    def sometimes(prompts, completions, **kwargs):
        return [None if c == "skip" else 2.0 for c in completions]

    batch = make_batch([Prompt("a"), Prompt("b")], ["x", "skip", "y", "z"], group_size=2)
    out = WeightedSum([sometimes, FunctionReward(lambda prompts, completions, **k: [1.0] * 4, weight=0.5,
                                                 name="half")])(batch)
    assert out.total.tolist() == [[2.5, 0.5], [2.5, 2.5]]  # the None sample keeps only its other reward
    assert torch.isnan(out.breakdown["sometimes"][0, 1])
    from grpo_engine.logging import rollout_metrics

    metrics = rollout_metrics(batch, out)
    assert metrics["reward/sometimes/mean"] == 2.0 and metrics["reward/sometimes/none"] == 1.0
    with pytest.raises(RewardError, match=r"returned 'bad' for sample 0 .* or None when it does not apply"):
        FunctionReward(lambda prompts, completions, **k: ["bad"] * 4, name="bad")(batch.row_prompts,
                                                                                  batch.texts)
    with pytest.raises(ValueError, match="cannot key the logs; pass name="):
        FunctionReward(lambda prompts, completions: [])
    with pytest.raises(RewardError, match="normalize='each'"):
        WeightedSum([sometimes], normalize="each")(batch)


def test_a_reward_that_returned_none_cannot_be_a_group_statistic():
    """A curriculum's, a temperature controller's or SemanticEntropy's accuracy reward (and DynamicSampling's
    key, tests/test_dynamic_sampling.py) must score every sample: each names itself and the fix."""
    from grpo_engine.data.curriculum import group_accuracy
    from grpo_engine.entropy import AdaptiveTemperature, SemanticEntropy

    def sometimes(prompts, completions, **kwargs):
        return [None if c == "skip" else 1.0 for c in completions]

    batch = make_batch([Prompt("a"), Prompt("b")], ["x", "skip", "y", "z"], group_size=2)
    out = WeightedSum([sometimes,
                       FunctionReward(lambda prompts, completions, **k: [1.0] * 4, name="all")])(batch)
    assert group_accuracy(out, "all").tolist() == [1.0, 1.0]
    rule = (r"the reward 'sometimes' returned None for 1 of 4 samples .* "
            r"name a reward that scores every sample")
    with pytest.raises(ValueError, match=r"accuracy_reward='sometimes': " + rule):
        group_accuracy(out, "sometimes")
    with pytest.raises(ValueError, match=r"AdaptiveTemperature\(accuracy_reward='sometimes'\): " + rule):
        AdaptiveTemperature().on_rollout(None, None, None, batch=batch, rewards=out,
                                         uncertainty=torch.zeros(2))
    with pytest.raises(KeyError, match=r"AdaptiveTemperature\(accuracy_reward='nope'\): "
                                       r"not one of the rewards"):
        AdaptiveTemperature(accuracy_reward="nope").on_rollout(None, None, None, batch=batch, rewards=out,
                                                                uncertainty=torch.zeros(2))
    with pytest.raises(ValueError, match=r"SemanticEntropy\(correct_key='sometimes'\): " + rule):
        SemanticEntropy(among="wrong", correct_key="sometimes")(batch, out)


# -- TRL's reward conventions -------------------------------------------------------------------------------

CHAT_ROWS = [{"prompt": [{"role": "system", "content": "Answer with a number."},
                         {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                         {"role": "user", "content": f"{a}+{b}?"}], "solution": f"${a + b}$"}
             for a, b in ((3, 4), (5, 6))]


def test_conversational_data_reaches_a_reward_as_trl_passes_it(tmp_path):
    """Message prompts (a system turn, a few-shot turn): the completions arrive as assistant messages,
    with their sampled ids, the trainer's state, the ``solution`` column (also the target), and a
    ``log_metric`` whose numbers reach the log; bool scores count as 0 and 1."""
    seen = {}

    def graded(prompts, completions, completion_ids, trainer_state, solution, log_metric, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, solution=solution,
                    step=(trainer_state.global_step, trainer_state.max_steps), target=kwargs["target"])
        log_metric("ids_per_completion", sum(map(len, completion_ids)) / len(completion_ids))
        return [len(ids) % 2 == 0 for ids in completion_ids]

    tok = char_tokenizer()
    trainer = GRPOTrainer(tiny_llama(len(tok)), graded, Dataset.from_list(CHAT_ROWS),
                          GRPOConfig(output_dir=str(tmp_path), **SMALL), tokenizer=tok)
    metrics = trainer.step()
    assert seen["prompts"][0][0] == {"role": "system", "content": "Answer with a number."}
    assert len(seen["prompts"][0]) == 4 and seen["step"] == (0, 1)
    assert seen["solution"] == seen["target"] and seen["solution"][0] in ("$7$", "$11$")
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in seen["ids"]]
    assert seen["completions"] == [[{"role": "assistant", "content": t}] for t in texts]
    assert all(ids and all(isinstance(i, int) for i in ids) for ids in seen["ids"])
    lengths = [len(ids) for ids in seen["ids"]]
    assert metrics["reward/graded/ids_per_completion"] == pytest.approx(sum(lengths) / len(lengths))
    assert metrics["reward/graded/mean"] == pytest.approx(sum(n % 2 == 0 for n in lengths) / len(lengths))


def test_completions_are_text_for_text_prompts_or_when_asked():
    got = []

    def record(completions, **kwargs):
        got.append(completions)
        return [0.0] * len(completions)

    chat = Prompt(({"role": "user", "content": "hi"},))
    batch = make_batch([chat], ["a", "b"], group_size=2)
    FunctionReward(record)(batch.row_prompts, batch.texts)
    FunctionReward(record, conversational=False)(batch.row_prompts, batch.texts)
    FunctionReward(record, conversational=True)([Prompt("hi"), Prompt("hi")], ["a", "b"])
    FunctionReward(record)([Prompt("hi"), Prompt("hi")], ["a", "b"])
    message = [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    assert got == [message, ["a", "b"], message, ["a", "b"]]
    with pytest.raises(ValueError, match="conversational='yes' must be None"):
        FunctionReward(record, conversational="yes")
    with pytest.raises(RewardError, match=r"log_metric\('x', 'high'\): give a metric name and a number"):
        FunctionReward(lambda completions, log_metric, **k: log_metric("x", "high"), name="m")(
            batch.row_prompts, batch.texts)


def test_the_functions_of_trl_rewards_work_as_they_are():
    """``trl.rewards``' accuracy (math-verify on the ``solution`` column; None where the gold answer does not
    parse), think-format and soft-overlong rewards, each scored here as TRL scores it."""
    trl_rewards = pytest.importorskip("trl.rewards")
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "solution": "$2$"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "solution": "not math at all"}]
    prompts = to_prompts(rows)
    texts = ["<think>easy</think>The answer is $\\boxed{2}$.", "I think 3", "<think>hm</think>$4$", "4"]
    batch = make_batch(prompts, texts, group_size=2)
    ids = [[5] * 3, [5] * 5, [5] * 7, [5] * 2]
    batch = dataclasses.replace(batch, completion_ids=torch.tensor([i + [0] * (7 - len(i)) for i in ids]),
                                completion_mask=torch.tensor([[j < len(i) for j in range(7)] for i in ids]))
    overlong = trl_rewards.get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=2)
    out = WeightedSum([trl_rewards.accuracy_reward, trl_rewards.think_format_reward, overlong])(batch)
    accuracy = out.breakdown["accuracy_reward"].flatten()
    assert accuracy[:2].tolist() == [1.0, 0.0] and accuracy[2:].isnan().all()
    assert out.breakdown["think_format_reward"].flatten().tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.breakdown["soft_overlong_punishment_reward"].flatten().tolist() == [0.0, -0.5, -1.0, 0.0]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    assert accuracy[:2].tolist() == trl_rewards.accuracy_reward(completions[:2], ["$2$"] * 2)
    assert out.total.flatten().tolist() == [2.0, -0.5, 0.0, 0.0]


# -- peft as users write it ----------------------------------------------------------------------------------


def test_a_peft_lora_config_is_taken_and_unsupported_settings_are_named():
    from peft import LoraConfig

    plan = MemoryPlan(lora=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                      target_modules=["q_proj", "v_proj"]))
    assert plan.lora == LoRA(r=8, alpha=16, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match=r"LoraConfig settings \{'use_dora': True\} are not supported"):
        MemoryPlan(lora=LoraConfig(r=8, use_dora=True, target_modules="all-linear"))
    assert LoRA(r=4).alpha == 8.0 and LoRA().alpha == 32.0  # one default everywhere: alpha = 2 r


def test_a_peft_model_is_trained_as_it_is_and_refused_with_a_second_lora(tmp_path):
    from peft import LoraConfig, get_peft_model

    tok = char_tokenizer()
    model = get_peft_model(tiny_llama(len(tok)), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="already a PeftModel .* pass MemoryPlan\\(lora=None\\)"):
        GRPOTrainer(model, [DigitShare()], PROMPTS, GRPOConfig(output_dir=str(tmp_path), **SMALL),
                    MemoryPlan(lora=LoRA(r=2)), tokenizer=tok, template=TEMPLATE)
    trainer = GRPOTrainer(model, [DigitShare()], PROMPTS, GRPOConfig(output_dir=str(tmp_path), **SMALL),
                          MemoryPlan(), tokenizer=tok, template=TEMPLATE)
    trained = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert trained and all("lora_" in n and "q_proj" in n for n in trained)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trained)  # the base is frozen
    assert any(not torch.equal(before[n], after[n]) for n in trained)  # the adapter learned
    assert (tmp_path / "final" / "adapter_config.json").is_file()


def test_known_third_party_noise_is_silenced_where_it_arises():
    import logging
    import warnings

    from peft import LoraConfig, get_peft_model

    from grpo_engine.memory import prepare_model

    tok = char_tokenizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_model(tiny_llama(len(tok)), MemoryPlan(lora=LoRA(r=2)))
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:  # outside our calls the warning is untouched
        warnings.simplefilter("always")
        get_peft_model(tiny_llama(len(tok)), LoraConfig(r=2, target_modules=["q_proj"]))
    assert [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert not logger.filter(logger.makeRecord(logger.name, logging.WARNING, "f", 1, "Failed to load CPU "
                                               "gemm_4bit_forward from kernels-community: %s", ("x",), None))
    assert logger.filter(logger.makeRecord(logger.name, logging.WARNING, "f", 1, "another message", (), None))


# -- errors, overrides, example config -----------------------------------------------------------------------


def test_cli_set_overrides_are_validated_like_the_file(tmp_path, capsys, tiny_folder):
    run = tmp_path / "run.yaml"
    run.write_text(example_config(model=str(tiny_folder)))
    assert main(["train", str(run), "--set", "config.group_size=1", "config.learning_rat=1e-4"]) == 2
    err = capsys.readouterr().err
    assert "with --set" in err and "config.group_size: group_size=1 makes every advantage 0" in err
    assert "config.learning_rat: unknown field; did you mean 'learning_rate'?" in err
    assert main(["train", str(run), "--set", "nonsense"]) == 2
    assert "write FIELD=VALUE" in capsys.readouterr().err


def test_cli_names_import_and_data_errors_without_a_traceback(tmp_path, capsys, tiny_folder):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": ""}\n')
    for prompts, message in [
        ("{function: grpo_engine.data.load_jsonll_prompts}",
         "grpo_engine.data has no 'load_jsonll_prompts'; "
         "did you mean 'grpo_engine.data.load_jsonl_prompts'?"),
        ("{function: grpo_engine.dta.load_gsm8k}",
         "no module 'grpo_engine.dta'; did you mean 'grpo_engine.data'?"),
        (f"{{function: grpo_engine.data.load_jsonl_prompts, path: {data}}}", "'answer' is empty"),
    ]:
        run = tmp_path / "run.yaml"
        run.write_text(f"model: {tiny_folder}\ntrain_prompts: {prompts}\n"
                       f"rewards: [{{class: grpo_engine.rewards.MathAccuracy}}]\n"
                       f"config: {{output_dir: {tmp_path / 'out'}}}\n")
        assert main(["train", str(run)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_example_config_runs_on_the_bundled_task_or_the_data_given(tmp_path, tiny_folder):
    spec = RunSpec.from_yaml(example_config(model=str(tiny_folder)))
    assert spec.train_prompts.target == "grpo_engine.data.arithmetic_task"
    gsm = RunSpec.from_yaml(example_config("/data/gsm8k/train.jsonl"))
    assert gsm.train_prompts.target == "grpo_engine.data.load_gsm8k"
    assert gsm.train_prompts.kwargs == {"path": "/data/gsm8k/train.jsonl"}
    run = tmp_path / "run.yaml"
    run.write_text(example_config(model=str(tiny_folder)))
    out = tmp_path / "out"
    assert main(["train", str(run), "--set", f"config.output_dir={out}", "config.max_steps=1",
                 "config.group_size=2", "config.max_completion_tokens=4", "config.progress_bar=false",
                 "memory.optimizer=adamw", "memory.gradient_checkpointing=false"]) == 0
    assert (out / "final" / "adapter_config.json").is_file()


# -- logging backends ----------------------------------------------------------------------------------------


def test_tensorboard_events_hold_every_logged_metric(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tok = char_tokenizer()
    trainer = GRPOTrainer(tiny_llama(len(tok)), [DigitShare()], PROMPTS,
                          GRPOConfig(output_dir=str(tmp_path), report_to=["tensorboard"],
                                     **{**SMALL, "max_steps": 2}),
                          tokenizer=tok, template=TEMPLATE)
    history = trainer.train()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("reward/mean", "loss", "reward/digit_share/mean", "lr"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2]
        assert [s.value for s in scalars] == pytest.approx([h[key] for h in history], rel=1e-6)


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file (its record log: 7-byte header, then 32 KiB blocks of
    records with a 7-byte header each: checksum, length, kind)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, rows = run_file.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_and_trackio_local_runs_hold_every_step(tmp_path, monkeypatch):
    import sqlite3

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from grpo_engine.report import TrackioLogger, WandbLogger, report_callbacks

    assert [type(c) for c in report_callbacks(["wandb", "trackio"])] == [WandbLogger, TrackioLogger]

    # trackio reads TRACKIO_DIR once, when first imported
    project = f"grpo_engine_test_{uuid.uuid4().hex[:8]}"
    tok = char_tokenizer()
    trainer = GRPOTrainer(tiny_llama(len(tok)), [DigitShare()], PROMPTS,
                          GRPOConfig(output_dir=str(tmp_path), **{**SMALL, "max_steps": 2}), tokenizer=tok,
                          template=TEMPLATE, callbacks=[WandbLogger(), TrackioLogger(project=project)])
    history = trainer.train()
    rows = wandb_history(next(tmp_path.glob("wandb/offline-run-*/run-*.wandb")))
    assert [row["_step"] for row in rows] == [1, 2]
    assert [row["loss"] for row in rows] == pytest.approx([h["loss"] for h in history], rel=1e-6)
    assert [row["reward/digit_share/mean"] for row in rows] == pytest.approx(
        [h["reward/digit_share/mean"] for h in history], rel=1e-6)
    from trackio.sqlite_storage import SQLiteStorage

    db_path = SQLiteStorage.get_project_db_path(project)
    try:
        with sqlite3.connect(db_path) as db:
            logged = db.execute("select step, metrics from metrics order by step").fetchall()
    finally:
        for leftover in db_path.parent.glob(f"{project}.*"):
            leftover.unlink()
    assert [step for step, _ in logged] == [1, 2]
    assert [json.loads(m)["loss"] for _, m in logged] == pytest.approx([h["loss"] for h in history], rel=1e-6)


# -- export --------------------------------------------------------------------------------------------------


def test_export_merges_the_adapter_into_a_plain_transformers_folder(tmp_path, tiny_folder):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    trainer = GRPOTrainer(str(tiny_folder), [DigitShare()], PROMPTS, GRPOConfig(output_dir=str(out), **SMALL),
                          MemoryPlan(lora=LoRA(r=2)), template=TEMPLATE)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: B is no longer zero
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        with trainer.model.disable_adapter():
            assert (trainer.model(input_ids=ids).logits - expected).abs().max() > 1e-2  # the adapter matters
    trainer.save(out / "final")
    trainer.save_merged(tmp_path / "merged")
    (out / "run.yaml").write_text(f"model: {tiny_folder}\n")
    assert main(["export", str(out), "--merge", str(tmp_path / "exported")]) == 0
    for folder in ("merged", "exported"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        assert not any("lora" in name for name in model.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert any("lora_" in n for n, _ in trainer.model.named_parameters())  # the policy keeps its adapter


# -- docs/from_trl.md, as written ----------------------------------------------------------------------------


def test_the_from_trl_script_runs_as_written(tmp_path, tiny_folder, monkeypatch):
    text = (DOCS / "from_trl.md").read_text()
    code = re.search(r"<!-- grpo_engine side -->\n```python\n(.*?)```", text, re.DOTALL).group(1)
    dataset = Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4"], "completion": ["3", "7"]})
    replaced = (code.replace('load_dataset("trl-lib/tldr", split="train")', "DATASET")
                .replace('"Qwen/Qwen2-0.5B-Instruct"', json.dumps(str(tiny_folder)))
                .replace('output_dir="Qwen2-0.5B-GRPO"', f"output_dir={str(tmp_path)!r}")
                .replace("max_completion_tokens=64, max_steps=100",
                         "max_completion_tokens=4, max_steps=1, prompts_per_step=2, progress_bar=False"))
    assert replaced.count("DATASET") == 1 and str(tmp_path) in replaced and "max_steps=1" in replaced
    namespace = {"DATASET": dataset}
    exec(compile(replaced, "docs/from_trl.md", "exec"), namespace)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and "reward/reward_len/mean" in json.loads(lines[0])
