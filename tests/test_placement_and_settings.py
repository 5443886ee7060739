"""What a TRL script expects of the trainer around it (issue 52): a model object goes to the GPU, a sampler
passed in samples with the run's settings (or the trainer says which disagree), and W&B's environment
variables hold. No GPU is needed: the World is told it has one, and the model records where it is sent."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from grpo_engine import GRPOConfig, GRPOTrainer
from grpo_engine.models import place_model
from grpo_engine.sampling import DynamicSampling, HFSampler, agreed_config
from grpo_engine.tools.rollout import ToolSampler
from grpo_engine.world import World
from tests.test_tools import TEMPLATE as CHAT_TEMPLATE
from tests.test_tools import EveryTurnCalls, echo, turn_taking_model
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare
from tests.tiny import char_tokenizer, tiny_llama

SMALL = dict(prompts_per_step=2, group_size=2, max_steps=1, progress_bar=False)


SETTINGS_LOG = "grpo_engine.sampling.settings"


def logged(caplog, logger: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == logger]


@dataclass(frozen=True)
class GPUWorld(World):
    """A World on a machine with GPUs: its device is this rank's GPU."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank)


class Recorder(nn.Linear):
    """A module that records where ``.to()`` sends it (and stays where it is), on ``at`` as it claims."""

    def __init__(self, at: str = "cpu") -> None:
        super().__init__(2, 2)
        self.at, self.sent = torch.device(at), []

    def parameters(self, recurse: bool = True):
        yield SimpleNamespace(device=self.at)

    def to(self, *args, **kwargs):
        self.sent.append(args[0])
        return self


# -- placement --------------------------------------------------------------------------------------


def test_a_model_object_goes_to_the_gpu_with_a_log_line_unless_kept(caplog):
    caplog.set_level(logging.INFO, logger="grpo_engine.models")
    moved = Recorder()
    assert place_model(moved, GPUWorld(), loaded_here=False, quantized=False) is moved
    assert moved.sent == [torch.device("cuda", 0)]
    assert logged(caplog, "grpo_engine.models") == [
        "moving the model from cpu to cuda:0 (GRPOConfig(place_model='keep') leaves it where it is)"]
    kept = Recorder()
    place_model(kept, GPUWorld(), loaded_here=False, quantized=False, placement="keep")
    on_cpu = Recorder()
    place_model(on_cpu, World(), loaded_here=False, quantized=False)  # no GPU: nothing moves
    there = Recorder("cuda:0")
    place_model(there, GPUWorld(), loaded_here=False, quantized=False)
    assert kept.sent == on_cpu.sent == there.sent == [] and len(logged(caplog, "grpo_engine.models")) == 1
    # under torchrun a model on another GPU goes to this rank's, "keep" or not
    elsewhere = Recorder("cuda:0")
    place_model(elsewhere, GPUWorld(rank=1, size=2, local_rank=1), loaded_here=False, quantized=False,
                placement="keep")
    assert elsewhere.sent == [torch.device("cuda", 1)]
    assert logged(caplog, "grpo_engine.models")[-1] == (
        "moving the model from cuda:0 to cuda:1 (under torchrun each rank trains on its own GPU)")


def test_a_quantised_or_dispatched_model_stays_where_it_is_and_the_log_says_why(caplog):
    caplog.set_level(logging.INFO, logger="grpo_engine.models")
    quantised, dispatched = Recorder("cuda:0"), Recorder("cuda:0")
    quantised.is_loaded_in_4bit = True
    dispatched.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1, "lm_head": "cpu"}
    world = GPUWorld(rank=1, size=2, local_rank=1)
    for model in (quantised, dispatched):
        place_model(model, world, loaded_here=False, quantized=False)
        assert model.sent == []
    assert logged(caplog, "grpo_engine.models") == [
        "the model stays on cuda:0, not on this rank's cuda:1: a bitsandbytes-quantised model trains where "
        "it was loaded; load it onto this GPU (from_pretrained(..., device_map=...)) or pass its folder to "
        "GRPOTrainer",
        "the model stays on cuda:0, not on this rank's cuda:1: its hf_device_map spreads it over ['0', '1', "
        "'cpu']; it trains as it was dispatched"]


@pytest.mark.parametrize("placement, sent", [("auto", [torch.device("cuda", 0)]), ("keep", [])])
def test_the_trainer_places_a_model_object_as_its_config_says(tmp_path, monkeypatch, placement, sent):
    monkeypatch.setattr(World, "device", property(lambda self: torch.device("cuda", self.local_rank)))
    tok = char_tokenizer()
    model, moves = tiny_llama(len(tok)), []
    real_to = model.to

    def to(*args, **kwargs):  # record a move to a device; a cast (prepare_model's dtype) runs
        if args and isinstance(args[0], torch.device):
            moves.append(args[0])
            return model
        return real_to(*args, **kwargs)

    model.to = to
    config = GRPOConfig(output_dir=str(tmp_path), place_model=placement, max_completion_tokens=4, **SMALL)
    GRPOTrainer(model, [DigitShare()], PROMPTS, config, tokenizer=tok, template=TEMPLATE)
    assert moves == sent


def test_place_model_takes_auto_or_keep_only():
    with pytest.raises(ValueError, match=r"place_model: Input should be 'auto' or 'keep' \(got 'cpu'\)"):
        GRPOConfig(place_model="cpu")


# -- a sampler's settings -------------------------------------------------------------------------------


def trainer_with(sampler, tmp_path, model=None, **config):
    tok = sampler.tokenizer if sampler is not None else char_tokenizer()
    model = model if model is not None else sampler.model
    config = GRPOConfig(output_dir=str(tmp_path), **SMALL, **config)
    return GRPOTrainer(model, [DigitShare()], PROMPTS, config, tokenizer=tok, template=TEMPLATE,
                       sampler=sampler)


def hf_sampler(**settings):
    tok = char_tokenizer()
    return HFSampler(tiny_llama(len(tok)), tok, template=TEMPLATE, **settings)


def test_defaults_on_both_sides_agree_without_a_word(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=SETTINGS_LOG)
    sampler = hf_sampler()
    assert sampler.settings_given == frozenset()
    trainer = trainer_with(sampler, tmp_path)
    assert trainer.config.model_dump() == GRPOConfig(output_dir=str(tmp_path), **SMALL).model_dump()
    assert logged(caplog, SETTINGS_LOG) == []


def test_settings_given_to_the_sampler_become_the_runs(tmp_path, caplog):
    """The config left them out: the trainer samples 3 tokens at most, at temperature 0.5, and computes its
    log-probs at 0.5 (the state's temperature, which AdaptiveTemperature would move from there)."""
    caplog.set_level(logging.INFO, logger=SETTINGS_LOG)
    sampler = hf_sampler(max_completion_tokens=3, temperature=0.5, top_k=7)
    assert sampler.settings_given == {"max_completion_tokens", "temperature", "top_k"}
    trainer = trainer_with(sampler, tmp_path)
    config = trainer.config
    assert (config.max_completion_tokens, config.temperature, config.top_k) == (3, 0.5, 7)
    assert trainer.temperature == 0.5 and trainer.config.max_prompt_tokens == 512
    assert logged(caplog, SETTINGS_LOG) == ["GRPOConfig takes the sampler's max_completion_tokens=3, "
                                            "temperature=0.5, top_k=7 (they were left out of the config)"]
    metrics = trainer.step()
    assert metrics["temperature"] == 0.5 and metrics["completion_length/max"] <= 3


def test_settings_given_to_the_config_reach_the_sampler(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=SETTINGS_LOG)
    sampler = hf_sampler()
    trainer = trainer_with(sampler, tmp_path, max_completion_tokens=2, top_p=0.9, max_prompt_tokens=64)
    assert (sampler.max_completion_tokens, sampler.top_p, sampler.max_prompt_tokens) == (2, 0.9, 64)
    assert trainer.sampler is sampler and trainer.config.max_completion_tokens == 2
    names = ("max_prompt_tokens=64", "max_completion_tokens=2", "top_p=0.9")
    told = "the sampler takes GRPOConfig's {} (it was built without one)"
    assert logged(caplog, SETTINGS_LOG) == [told.format(name) for name in names]
    batch = sampler.sample(PROMPTS[:1], group_size=2)
    assert batch.completion_ids.shape[1] <= 2


def test_settings_given_on_both_sides_differently_are_one_error_naming_each(tmp_path):
    sampler = hf_sampler(max_completion_tokens=8, temperature=0.7, top_p=0.95, top_k=5)
    with pytest.raises(ValueError) as caught:
        trainer_with(sampler, tmp_path, max_completion_tokens=4, temperature=0.7, top_p=0.9, top_k=0)
    assert str(caught.value) == (
        "the sampler passed to GRPOTrainer and its GRPOConfig set 3 sampling setting(s) differently:\n"
        "  - max_completion_tokens: HFSampler(max_completion_tokens=8), GRPOConfig(max_completion_tokens=4)\n"
        "  - top_p: HFSampler(top_p=0.95), GRPOConfig(top_p=0.9)\n"
        "  - top_k: HFSampler(top_k=5), GRPOConfig(top_k=0)\n"
        "set each in one place: in the sampler (leave it out of GRPOConfig) or in GRPOConfig (leave it out "
        "of the sampler, which then takes the config's)")
    assert sampler.max_completion_tokens == 8  # nothing was changed on the way to the error


def test_a_tool_sampler_agrees_through_the_sampler_it_wraps(tmp_path):
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = turn_taking_model(tok)
    sampler = ToolSampler(HFSampler(model, tok, max_completion_tokens=40), tools=[echo], max_turns=2,
                          parser=EveryTurnCalls())
    config = GRPOConfig(output_dir=str(tmp_path), top_k=9, **SMALL)
    trainer = GRPOTrainer(model, [DigitShare()], PROMPTS, config, tokenizer=tok, sampler=sampler)
    assert (trainer.config.max_completion_tokens, sampler.base.top_k) == (40, 9)
    with pytest.raises(ValueError, match=r"max_completion_tokens: HFSampler\(max_completion_tokens=40\), "
                                         r"GRPOConfig\(max_completion_tokens=48\)"):
        agreed_config(sampler, GRPOConfig(max_completion_tokens=48))


def test_a_sampler_of_your_own_counts_what_it_has_as_set_and_a_group_filter_has_none():
    class Own:
        max_completion_tokens, temperature = 64, 0.8

    config = agreed_config(Own(), GRPOConfig(top_p=0.5))
    assert (config.max_completion_tokens, config.temperature, config.top_p) == (64, 0.8, 0.5)
    assert config.model_fields_set == {"max_completion_tokens", "temperature", "top_p"}
    with pytest.raises(ValueError, match=r"1 sampling setting\(s\) differently:\n  - temperature: "
                                         r"Own\(temperature=0.8\), GRPOConfig\(temperature=1.0\)\n"):
        agreed_config(Own(), GRPOConfig(temperature=1.0))
    config = GRPOConfig(max_completion_tokens=9)
    assert agreed_config(DynamicSampling(), config) is config and agreed_config(None, config) is config


def test_the_vllm_samplers_record_the_settings_they_were_given(tiny_model, tokenizer, tmp_path):
    from grpo_engine.sampling.vllm_server import VLLMServerSampler

    sampler = VLLMServerSampler(tiny_model, tokenizer, base_url="http://127.0.0.1:9", sync_dir=tmp_path,
                                max_completion_tokens=8, top_p=0.9)
    assert sampler.settings_given == {"max_completion_tokens", "top_p"}
    config = agreed_config(sampler, GRPOConfig(max_prompt_tokens=100, temperature=0.6))
    assert (config.max_completion_tokens, config.top_p) == (8, 0.9)
    assert (sampler.max_prompt_tokens, sampler.temperature) == (100, 0.6)


# -- W&B ------------------------------------------------------------------------------------------------


def wandb_run_record(run_file):
    """The run record (project, name, group) of an offline W&B run file: its record log, a 7-byte header,
    then 32 KiB blocks of records with a 7-byte header each (checksum, length, kind)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = run_file.read_bytes(), 7, b""
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
            if record.WhichOneof("record_type") == "run":
                return record.run
    raise AssertionError(f"no run record in {run_file}")


def test_wandb_arguments_come_from_the_logger_then_the_environment_then_ours(monkeypatch):
    from grpo_engine.report import WandbLogger

    for variable in WandbLogger.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    assert WandbLogger().init_arguments("runs/x", {"a": 1}) == {"project": "grpo_engine", "config": {"a": 1},
                                                                  "dir": "runs/x"}
    for variable, value in [("WANDB_PROJECT", "from_env"), ("WANDB_DIR", "/tmp/w"), ("WANDB_ENTITY", "team"),
                            ("WANDB_NAME", "run_1"), ("WANDB_RUN_GROUP", "sweep"), ("WANDB_TAGS", "a, b")]:
        monkeypatch.setenv(variable, value)
    assert WandbLogger().init_arguments("runs/x", {}) == {
        "project": "from_env", "dir": "/tmp/w", "config": {}, "entity": "team", "name": "run_1",
        "group": "sweep", "tags": ["a", "b"]}
    assert WandbLogger(project="mine", dir="d", name="n").init_arguments("runs/x", {}) == {
        "project": "mine", "dir": "d", "config": {}, "entity": "team", "name": "n", "group": "sweep",
        "tags": ["a", "b"]}


def test_an_offline_wandb_run_takes_its_project_name_and_group_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "trl_project")
    monkeypatch.setenv("WANDB_NAME", "trl_run")
    monkeypatch.setenv("WANDB_RUN_GROUP", "sweep_7")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "tracking"))
    (tmp_path / "tracking").mkdir()
    tok = char_tokenizer()
    config = GRPOConfig(output_dir=str(tmp_path / "out"), report_to=["wandb"], max_completion_tokens=4,
                        **SMALL)
    model = tiny_llama(len(tok))
    GRPOTrainer(model, [DigitShare()], PROMPTS, config, tokenizer=tok, template=TEMPLATE).train()
    assert not (tmp_path / "out" / "wandb").exists()  # WANDB_DIR holds over the output folder
    run = wandb_run_record(next(tmp_path.glob("tracking/wandb/offline-run-*/run-*.wandb")))
    assert (run.project, run.display_name, run.run_group) == ("trl_project", "trl_run", "sweep_7")
