"""TRL's entry point (grpo_engine.trl): the field table against trl, the config resolved as TRL resolves
it, the mapping onto the native records (numbers, not motion), every refusal naming field, why and nearest,
and TRL's quickstart run with only its import line changed, on the tiny model."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import math
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from grpo_engine.callbacks import Callback
from grpo_engine.losses.clipped import ClippedSurrogate
from grpo_engine.losses.terms import RatioWeightedKL
from grpo_engine.trl import GRPOConfig, GRPOTrainer, TRLSettingError
from grpo_engine.trl.fields import TRL_FIELDS, TRL_TYPES, TRL_VERSION
from grpo_engine.trl.mapping import Schedule, VLLMPlan, native_run
from grpo_engine.trl.refused import MAPPED, REFUSED
from grpo_engine.trl.trainer import trl_rewards, trl_scheduler
from grpo_engine.types import MicroBatch
from tests.trl_types import type_text

DOCS = Path(__file__).resolve().parents[1] / "docs"
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning",
                                        "ignore:step \\d+. every group has identical rewards")


def _plain(value):
    """An enum as its value, a list of them as a list of values (TrainingArguments' enums are strings)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, enum.Enum) else value


def _trl():
    trl = pytest.importorskip("trl")
    if trl.__version__ != TRL_VERSION:
        pytest.skip(f"the table is TRL {TRL_VERSION}'s; trl {trl.__version__} is installed")
    return trl


def test_the_field_table_is_trls():
    """Every field of trl.GRPOConfig, in TRL's order, with TRL's default (regenerate the table from
    dataclasses.fields(trl.GRPOConfig) when trl moves)."""
    trl = _trl()
    theirs = {}
    for f in dataclasses.fields(trl.GRPOConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        theirs[f.name] = _plain(default)
    assert len(theirs) == 191 and list(TRL_FIELDS) == list(theirs)
    assert TRL_FIELDS == theirs


def test_the_field_types_are_trls_over_builtins():
    trl = _trl()
    assert TRL_TYPES == {f.name: type_text(f.type) for f in dataclasses.fields(trl.GRPOConfig)}


def test_a_command_line_parses_as_trls_does():
    """TRL's scripts parse GRPOConfig from the command line (HfArgumentParser, TRL's TrlParser)."""
    from transformers import HfArgumentParser

    argv = ["--output_dir", "o", "--num_generations", "4", "--learning_rate", "3e-6", "--bf16", "false",
            "--report_to", "none", "--lr_scheduler_type", "cosine", "--max_completion_length", "128",
            "--gradient_checkpointing", "false", "--reward_weights", "1.0", "0.5", "--use_vllm", "true",
            "--logging_steps", "5", "--eval_strategy", "steps", "--eval_steps", "0.5"]
    (ours,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(argv)
    trl = _trl()
    (theirs,) = trl.TrlParser(trl.GRPOConfig).parse_args_and_config(argv + ["--use_cpu", "true"])
    (via_trl,) = trl.TrlParser(GRPOConfig).parse_args_and_config(argv + ["--use_cpu", "true"])
    skip = {"accelerator_config", "dataloader_pin_memory", "epsilon_high"}  # as in the resolution test
    for parsed in (ours, via_trl):
        pairs = {f.name: (getattr(parsed, f.name), _plain(getattr(theirs, f.name)))
                 for f in dataclasses.fields(theirs) if f.name not in skip | {"use_cpu"}}
        assert {name: pair for name, pair in pairs.items() if pair[0] != pair[1]} == {}
    assert (ours.lr_scheduler_type, ours.eval_strategy) == ("cosine", "steps")
    assert ours.reward_weights == [1.0, 0.5]


def test_every_field_is_mapped_or_refused():
    assert set(MAPPED) | set(REFUSED) == set(TRL_FIELDS) and not set(MAPPED) & set(REFUSED)


@pytest.mark.parametrize("kwargs", [
    {}, {"num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    {"generation_batch_size": 16, "per_device_train_batch_size": 4}, {"steps_per_generation": 3},
    {"scale_rewards": False, "epsilon": 0.1}, {"eval_strategy": "steps", "logging_steps": 5, "bf16": False},
    {"report_to": "tensorboard", "gradient_checkpointing": False, "epsilon_high": 0.28}])
def test_the_config_resolves_as_trl_does(kwargs):
    trl = _trl()
    ours = GRPOConfig(output_dir="o", use_cpu=True, **kwargs)
    theirs = trl.GRPOConfig("o", use_cpu=True, **kwargs)
    # accelerate's objects, and TRL's trainer (not its config) resolves epsilon_high
    skip = {"accelerator_config", "dataloader_pin_memory", "epsilon_high"}
    pairs = {f.name: (getattr(ours, f.name), _plain(getattr(theirs, f.name)))
             for f in dataclasses.fields(theirs)}
    assert {name: pair for name, pair in pairs.items() if name not in skip and pair[0] != pair[1]} == {}
    assert ours.epsilon_high == (theirs.epsilon_high if theirs.epsilon_high is not None else theirs.epsilon)


def test_an_unknown_keyword_is_a_type_error_and_trls_own_checks_hold():
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_generation'; did you mean "
                                        "'num_generations'"):
        GRPOConfig(num_generation=8)
    with pytest.raises(ValueError, match=r"generation_batch_size \(8\) must be divisible by num_generations"):
        GRPOConfig(num_generations=3)
    assert GRPOConfig("out").output_dir == "out" and GRPOConfig().output_dir == "trainer_output"


def run(num_prompts=100, context=4096, device_bf16=False, **kwargs):
    return native_run(GRPOConfig(**kwargs), num_prompts=num_prompts, context_tokens=context,
                      device_bf16=device_bf16)


def test_trls_defaults_become_these_native_settings():
    r = run(max_completion_length=64)
    c, m = r.config, r.memory
    assert (c.prompts_per_step, c.group_size, m.micro_batch_size, c.updates_per_batch) == (1, 8, 8, 1)
    assert c.max_steps == 300  # 3 epochs of 100 prompts, one prompt x 8 completions a step
    assert (c.learning_rate, c.adam_betas, c.adam_eps, c.weight_decay, c.max_grad_norm, c.seed) == (
        1e-6, (0.9, 0.999), 1e-8, 0.0, 1.0, 42)
    assert (c.log_every_steps, c.save_every_steps, c.max_completion_tokens, c.max_prompt_tokens) == (
        10, 500, 64, 4096 - 64)
    assert (c.lr_schedule, c.overlong_prompts, c.report_to, c.output_dir) == ("linear", "error", [],
                                                                              "trainer_output")
    assert m.gradient_checkpointing and m.compute_dtype is None and m.dtype == "float32"  # no bf16 GPU here
    assert r.notes and "bf16=True" in r.notes[0]
    loss = r.loss
    assert (loss.aggregation, loss.clip_eps_low, loss.clip_eps_high, loss.kl_coef) == ("token", 0.2, 0.2, 0.0)
    assert (r.advantage.std_scope, r.advantage.eps) == ("group", 1e-4)
    assert r.schedule == Schedule("linear", 0, 300, {}) and r.eval_every_steps is None


def test_the_generation_batch_becomes_prompts_per_step(monkeypatch):
    r = run(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    assert (r.config.prompts_per_step, r.memory.micro_batch_size) == (4, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run(num_generations=4, per_device_train_batch_size=8).config.prompts_per_step == 4
    with pytest.raises(TRLSettingError, match=r"per_device_train_batch_size=2: 1 prompt\(s\) a step across 2 "
                                              r"processes.*a multiple of num_generations=4"):
        run(num_generations=4, per_device_train_batch_size=2)
    with pytest.raises(TRLSettingError, match=r"steps_per_generation=2: a generation batch of 16 "
                                              r"completions spread over 2 / 1 optimizer steps.*nearest: "
                                              r"leave it unset.* = 8"):
        run(num_generations=4, per_device_train_batch_size=4, steps_per_generation=2)


def test_num_iterations_divides_trls_step_counts():
    c = run(num_iterations=2, max_steps=11, logging_steps=3, save_steps=5, warmup_steps=3,
            lr_scheduler_type="cosine").config
    assert (c.updates_per_batch, c.max_steps, c.log_every_steps, c.save_every_steps, c.warmup_steps) == (
        2, 6, 2, 3, 2)
    r = run(num_prompts=10, num_train_epochs=2, num_generations=4, per_device_train_batch_size=8,
            warmup_steps=0.1)  # 2 prompts a step: 5 a epoch, 10 in all; a warm-up of 10% is 1 step
    assert (r.config.max_steps, r.schedule.warmup_steps) == (10, 1)
    assert run(logging_steps=0.25, max_steps=40).config.log_every_steps == 10
    epochs = run(num_prompts=10, num_generations=4, per_device_train_batch_size=8, num_iterations=2,
                 save_strategy="epoch", logging_strategy="epoch", eval_strategy="epoch")
    c = epochs.config
    assert (c.save_every_steps, c.log_every_steps, epochs.eval_every_steps) == (5, 5, 5)
    assert run(logging_strategy="no", max_steps=7).config.log_every_steps == 8  # never
    with pytest.raises(TRLSettingError, match="save_strategy='epoch': an epoch has no length here"):
        run(num_prompts=None, max_steps=5, save_strategy="epoch")


def test_a_model_object_trains_in_its_own_dtype_and_ignores_the_loading_settings():
    """TRL trains a model passed in as it is and warns that model_init_kwargs and quantization_config
    (which apply to a name) are ignored."""
    r = native_run(GRPOConfig(model_init_kwargs={"dtype": "float16"}), num_prompts=8, context_tokens=4096,
                   device_bf16=True, model_dtype="bfloat16", quantization=object())
    assert (r.memory.dtype, r.memory.compute_dtype, r.memory.quantization) == ("bfloat16", None, None)
    assert [note.split(" is ")[0] for note in r.notes] == ["model_init_kwargs", "quantization_config"]
    assert run(disable_dropout=True).memory.dtype == "float32"  # dropout is always off here


def test_a_4_bit_nf4_base_under_peft_is_qlora():
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    r = native_run(GRPOConfig(bf16=False), num_prompts=8, context_tokens=4096, device_bf16=True, lora=lora,
                   quantization=nf4)
    assert (r.memory.quantization, r.memory.dtype, r.memory.compute_dtype, r.memory.lora.r) == (
        "nf4", "bfloat16", None, 8)
    assert not r.notes
    single = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    assert "quantised twice" in native_run(GRPOConfig(bf16=False), num_prompts=8, context_tokens=4096,
                                           device_bf16=False, lora=lora, quantization=single).notes[0]
    for quantization, peft in ((nf4, None), (BitsAndBytesConfig(load_in_8bit=True), lora)):
        with pytest.raises(TRLSettingError, match=r"quantization_config='BitsAndBytesConfig': a 4-bit base"):
            native_run(GRPOConfig(bf16=False), num_prompts=8, context_tokens=4096, device_bf16=False,
                       lora=peft, quantization=quantization)


def test_bookkeeping_settings_carry_over():
    c = run(report_to="tensorboard", disable_tqdm=True, save_strategy="no", save_total_limit=2, seed=7,
            max_tool_calling_iterations=3, temperature=0.7, top_p=0.9, top_k=20, max_grad_norm=0.0,
            weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, output_dir="o").config
    assert (c.report_to, c.progress_bar, c.save_every_steps, c.keep_last_checkpoints, c.seed) == (
        ["tensorboard"], False, None, 2, 7)
    assert (c.max_turns, c.temperature, c.top_p, c.top_k, c.max_grad_norm) == (4, 0.7, 0.9, 20, None)
    assert (c.weight_decay, c.adam_betas, c.adam_eps, c.output_dir) == (0.1, (0.8, 0.95), 1e-6, "o")
    assert run(max_completion_length=64).config.max_turns == 64  # TRL: no limit but the completion's
    assert run(torch_compile=True, gradient_checkpointing=False).memory.compile_training


@pytest.mark.parametrize("kwargs, expected", [
    ({"loss_type": "grpo"}, ("ClippedSurrogate", "sequence", 0.2, 0.2)),
    ({"loss_type": "dr_grpo", "max_completion_length": 32}, ("ClippedSurrogate", "constant", 0.2, 0.2)),
    ({"loss_type": "bnpo"}, ("ClippedSurrogate", "token", 0.2, 0.2)),
    ({"loss_type": "dapo", "epsilon_high": 0.28}, ("ClippedSurrogate", "token", 0.2, 0.28)),
    ({"loss_type": "cispo", "epsilon_high": 5.0}, ("CISPO", None, None, 4.0)),
    ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
     ("GSPO", None, 3e-4, 4e-4)),
])
def test_each_loss_type_becomes_its_loss(kwargs, expected):
    loss = run(**kwargs).loss
    found = (type(loss).__name__, getattr(loss, "aggregation", None), loss.clip_eps_low, loss.clip_eps_high)
    assert found == expected
    if kwargs["loss_type"] == "dr_grpo":
        assert loss.max_completion_tokens == 32


def test_loss_and_advantage_settings_carry_over():
    r = run(beta=0.04, use_bias_correction_kl=False, mask_truncated_completions=True,
            top_entropy_quantile=0.2, delta=2.0, scale_rewards="batch")
    loss = r.loss
    assert (loss.kl_coef, loss.mask_truncated, loss.top_entropy_quantile, loss.delta) == (0.04, True, 0.2, 2)
    assert r.advantage.std_scope == "batch" and run(scale_rewards=False).advantage.std_scope == "none"
    assert not loss.kl_ratio_weighted and loss.off_policy_mask_threshold is None
    weighted = run(beta=0.04, off_policy_mask_threshold=0.5).loss  # TRL's default use_bias_correction_kl
    assert (weighted.kl_coef, weighted.kl_ratio_weighted, weighted.off_policy_mask_threshold) == (
        0.04, True, 0.5)
    assert not run().loss.kl_ratio_weighted  # beta=0.0: no KL to weight


def test_the_bias_corrected_kl_has_the_ratios_gradient():
    """One token, logprob x = 0 on-policy, ref r = -1: k3 = e^(r-x) - (r-x) - 1 = e^-1, and
    d(r_t k3)/dx = k3 + dk3/dx = e^-1 + (1 - e^-1) = 1, where the unweighted KL's is 1 - e^-1."""
    logp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    batch = MicroBatch(completion_mask=torch.ones(1, 1, dtype=torch.bool), advantages=torch.zeros(1,
                       dtype=torch.float64), ref_logprobs=torch.full((1, 1), -1.0, dtype=torch.float64))
    for loss_fn, slope in ((ClippedSurrogate(aggregation="token", kl_coef=0.5, kl_ratio_weighted=True), 0.5),
                           (ClippedSurrogate(aggregation="token", terms=(RatioWeightedKL(0.5),)), 0.5),
                           (ClippedSurrogate(aggregation="token", kl_coef=0.5), 0.5 * (1 - math.exp(-1)))):
        logp.grad = None
        out = loss_fn(logp, batch, num_valid_tokens=1, num_sequences=1)
        out.loss.backward()
        assert out.loss.item() == pytest.approx(0.5 * math.exp(-1))
        assert logp.grad.item() == pytest.approx(slope)


@pytest.mark.parametrize("kwargs", [{"beta": 0.04}, {"beta": 0.04, "epsilon_high": 0.28, "loss_type": "grpo"},
                                    {"beta": 0.1, "use_bias_correction_kl": False, "loss_type": "dr_grpo"},
                                    {"beta": 0.1, "use_bias_correction_kl": False, "loss_type": "sapo",
                                     "sapo_temperature_pos": 0.9},
                                    {"beta": 0.04, "loss_type": "luspo", "epsilon_high": 0.28},
                                    {"beta": 0.04, "use_bias_correction_kl": False, "loss_type": "luspo",
                                     "importance_sampling_level": "sequence", "epsilon": 0.1},
                                    {"beta": 0.04, "use_bias_correction_kl": False, "loss_type": "vespo",
                                     "vespo_k_pos": 1.5, "vespo_lambda_neg": 2.5},
                                    {"beta": 0.04, "loss_type": "grpo", "off_policy_mask_threshold": 0.0},
                                    {"beta": 0.04, "entropy_coef": 0.05},
                                    {"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate",
                                     "vllm_importance_sampling_clip_min": 0.9,
                                     "vllm_importance_sampling_clip_max": 1.2},
                                    {"use_vllm": True, "vllm_importance_sampling_clip_min": 0.8,
                                     "off_policy_mask_threshold": 0.0, "beta": 0.04},
                                    {"use_vllm": True, "vllm_importance_sampling_mode": "token_mask",
                                     "vllm_importance_sampling_clip_min": 0.9,
                                     "vllm_importance_sampling_clip_max": None}])
def test_the_loss_is_trls_compute_loss(kwargs):
    """TRL 1.16's compute_loss written out in float64 (token level, clip, TRL's own off-policy sequence mask
    and vLLM importance ratio (its own lines, with clip_min), KL times the ratio when use_bias_correction_kl,
    its loss_type's aggregation, minus entropy_coef times the token-mean entropy): the same value and
    gradient, off-policy."""
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = -torch.rand(2, 3, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(2, 3, dtype=torch.float64)).requires_grad_()
    ref = old + 0.2 * torch.randn(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    entropy = torch.rand(2, 3, dtype=torch.float64)
    args = GRPOConfig(max_completion_length=3, bf16=False, **kwargs)
    sampler = old + 0.3 * torch.sin(7 * old) if args.use_vllm else None  # the sampler's log-probs
    loss_fn = native_run(args, num_prompts=8, context_tokens=4096, device_bf16=False).loss
    batch = MicroBatch(completion_mask=mask, advantages=adv, old_logprobs=old, ref_logprobs=ref,
                       entropy=entropy, sampler_logprobs=sampler)
    ours = loss_fn(logp, batch, num_valid_tokens=5, num_sequences=2).loss
    (grad,) = torch.autograd.grad(ours, logp)
    log_ratio = logp - old
    if args.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = coef_1.clamp(1 - args.epsilon, 1 + args.epsilon_high)
    per_token = -torch.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if args.loss_type == "vespo":  # TRL's own Gamma weights (a static method)
        phi = _trl().GRPOTrainer.get_gamma_weights(adv[:, None], logp.detach() - old, mask, None,
                                                    args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg,
                                                    args.vespo_lambda_neg)
        per_token = -phi * adv[:, None] * logp
    if args.loss_type == "sapo":
        tau = torch.where(adv[:, None] > 0, torch.tensor(args.sapo_temperature_pos, dtype=torch.float64),
                          torch.tensor(args.sapo_temperature_neg, dtype=torch.float64))
        per_token = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv[:, None]
    if args.off_policy_mask_threshold is not None:  # TRL's own mask (a static method); it drops row 2 here
        keep = _trl().GRPOTrainer.get_off_policy_mask(adv[:, None], logp, old if sampler is None else sampler,
                                                      mask.double(), args.off_policy_mask_threshold)
        assert keep.flatten().tolist() == [1.0, 0.0]
        per_token = per_token * keep
    if args.use_vllm:  # TRL's own importance-ratio lines (tests/test_loss_family_2.py runs them)
        from tests.test_loss_family_2 import trl_is_ratio

        per_token = per_token * trl_is_ratio(old, sampler, mask, args.vllm_importance_sampling_mode,
                                             args.vllm_importance_sampling_clip_min,
                                             args.vllm_importance_sampling_clip_max)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = per_token + args.beta * (kl * coef_1 if args.use_bias_correction_kl else kl)
    if args.loss_type in ("grpo", "sapo"):
        theirs = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    elif args.loss_type == "luspo":
        theirs = (per_token * mask).sum(-1).mean()
    elif args.loss_type == "dr_grpo":
        theirs = (per_token * mask).sum() / (2 * args.max_completion_length)
    else:
        theirs = (per_token * mask).sum() / mask.sum()
    theirs = theirs - args.entropy_coef * (entropy * mask).sum() / mask.sum()  # one micro-batch: its mean
    (expected,) = torch.autograd.grad(theirs, logp)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantage_is_trls(scale):
    """TRL 1.16: (r - the group's mean) / (the std, unbiased, of the group or of the batch + 1e-4)."""
    torch.manual_seed(0)
    rewards = torch.randn(3, 4, dtype=torch.float64)
    rewards[1] = 0.5  # a tied group: 0 in both
    ours = run(scale_rewards=scale).advantage(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    std = {"group": rewards.std(dim=1, keepdim=True), "batch": rewards.std(), "none": None}[scale]
    theirs = centered if std is None else centered / (std + 1e-4)
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12)


def test_normalize_then_sum_is_trls_gdpo():
    """multi_objective_aggregation='normalize_then_sum': each reward z-scored in its group (eps 1e-4), summed
    by weight, the sum whitened over the step (eps 1e-4; scale_rewards unused, as in TRL): the advantages of
    TRL's own lines, with a reward equal within a group (it adds 0 there)."""
    from grpo_engine.rewards.compose import WeightedSum
    from tests.test_loss_family_2 import trl_normalize_then_sum
    from tests.test_rewards import Fixed, Q, make_batch

    r = run(multi_objective_aggregation="normalize_then_sum", scale_rewards="none")
    assert (type(r.advantage).__name__, r.advantage.eps, r.reward_normalize) == (
        "ReinforcePlusPlusBaseline", 1e-4, "each")
    assert "returns None for some completions stops the run" in r.notes[-1]
    gen = torch.Generator().manual_seed(0)
    scores = torch.stack([torch.randint(0, 2, (12,), generator=gen).double(),
                          10 * torch.rand(12, generator=gen, dtype=torch.float64)], dim=1)
    scores[:4, 0] = 1.0
    weights = [1.0, -0.5]
    rewards = [Fixed(f"r{j}", scores[:, j].tolist(), weight=w) for j, w in enumerate(weights)]
    combined = trl_rewards(r, rewards)  # what build_native gives the native trainer
    assert isinstance(combined, WeightedSum) and (combined.normalize, combined.eps) == ("each", 1e-4)
    ours = r.advantage(combined(make_batch([Q] * 3, ["x"] * 12, group_size=4)).total).flatten().double()
    theirs = trl_normalize_then_sum(scores, torch.tensor(weights, dtype=torch.float64), 4)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert trl_rewards(run(), rewards) is rewards  # sum_then_normalize: summed by weight as they are


def test_adaptive_entropy_is_trls_controller_as_a_loss_term_and_a_callback():
    """use_adaptive_entropy, entropy_coef 0.02, delta 0.01, target 0.3, c in [0.01, 0.04]: one
    AdaptiveEntropyBonus, the loss's term and the run's callback. Entropies 0.1, 0.1, 0.5, 0.1 over four steps
    of one token-mean micro-batch (A = 1, on-policy: the policy term is -1); TRL applies c when the previous
    step's entropy was <= 0.3 and then moves c by 0.01 within the bounds: α = 0, .03, .04, 0 and c = .03,
    .04, .03, .04, so the losses are -1 - α·H."""
    r = run(use_adaptive_entropy=True, entropy_coef=0.02, entropy_coef_delta=0.01, entropy_target=0.3,
            entropy_coef_min=0.01, entropy_coef_max=0.04)
    (bonus,) = r.callbacks
    assert r.loss.terms == (bonus,) and r.loss.entropy_coef == 0.0
    assert (bonus.entropy_target, bonus.start_coef, bonus.delta, bonus.coef_min, bonus.coef_max) == (
        0.3, 0.02, 0.01, 0.01, 0.04)
    mask = torch.ones(1, 4, dtype=torch.bool)
    losses, coefs = [], []
    for h in (0.1, 0.1, 0.5, 0.1):
        batch = MicroBatch(completion_mask=mask, advantages=torch.ones(1, dtype=torch.float64),
                           entropy=torch.full((1, 4), h, dtype=torch.float64))
        out = r.loss(torch.zeros(1, 4, dtype=torch.float64), batch, num_valid_tokens=4, num_sequences=1)
        losses.append(out.loss.item())
        metrics = {k: v.item() for k, v in out.metrics.items()}
        bonus.on_step_end(None, None, None, metrics=metrics)
        coefs.append(bonus.coef)
    want = [-1 - alpha * h for alpha, h in zip((0.0, 0.03, 0.04, 0.0), (0.1, 0.1, 0.5, 0.1))]
    assert losses == pytest.approx(want, rel=1e-12) and coefs == pytest.approx([0.03, 0.04, 0.03, 0.04])
    static = run(entropy_coef=0.05)
    assert (static.loss.entropy_coef, static.loss.terms, static.callbacks) == (0.05, (), ())


def test_sync_ref_model_is_reference_sync_every_tau_of_trls_steps():
    """sync_ref_model (beta > 0, full fine-tuning) -> ReferenceSync(alpha=ref_model_mixup_alpha). TRL mixes
    after optimizer steps 6, 12, 18 (ref_model_sync_steps=6); with num_iterations=2 each native step is two
    of them, so the sync comes every 3 native steps: 3, 6, 9. TRL's refusals (beta=0.0, peft_config) hold."""
    r = run(beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=6,
            num_iterations=2)
    (sync,) = r.callbacks
    assert (type(sync).__name__, sync.every_steps, sync.alpha) == ("ReferenceSync", 3, 0.5)
    trl_syncs = [k for k in range(1, 19) if k % 6 == 0]
    assert [step * 2 for step in range(1, 10) if step % sync.every_steps == 0] == trl_syncs
    default = run(beta=0.04, sync_ref_model=True).callbacks[0]
    assert (default.every_steps, default.alpha) == (512, 0.6) and run(beta=0.04).callbacks == ()
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    with pytest.raises(TRLSettingError, match=r"sync_ref_model=True: under peft_config .*TRL refuses it too"):
        native_run(GRPOConfig(beta=0.04, sync_ref_model=True, bf16=False), num_prompts=100,
                   context_tokens=4096, device_bf16=False, lora=lora)


def test_the_new_mappings_reach_the_native_trainer(tiny_folder, tmp_path):
    """A TRL run with sync_ref_model (every step, alpha 1: the reference becomes the policy),
    use_adaptive_entropy and normalize_then_sum trains two steps: the native trainer has the WeightedSum,
    the ReinforcePlusPlusBaseline, the bonus and the sync as callbacks, and logs each."""
    def longer(completions, **kwargs):
        return [float(len(c)) for c in completions]

    data = Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4"]})
    args = _args(tmp_path, max_steps=2, beta=0.04, sync_ref_model=True, ref_model_sync_steps=1,
                 ref_model_mixup_alpha=1.0, use_adaptive_entropy=True, entropy_coef=0.01,
                 multi_objective_aggregation="normalize_then_sum", learning_rate=1e-3)
    trainer = GRPOTrainer(str(tiny_folder), [_reward_len, longer], args, train_dataset=data)
    native = trainer.native
    assert (native.rewards.normalize, native.rewards.eps) == ("each", 1e-4)
    assert type(native.advantage).__name__ == "ReinforcePlusPlusBaseline"
    assert [type(c).__name__ for c in native.callbacks][-2:] == ["AdaptiveEntropyBonus", "ReferenceSync"]
    trainer.train()
    last = native.history[-1]
    assert last["reference/synced"] == 1.0 and "entropy_coef" in last
    with native.reference.active() as reference:
        for ours, theirs in zip(native.model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(ours, theirs)


def test_precision_follows_trl():
    assert run(device_bf16=True).memory.compute_dtype == "bfloat16"
    assert run(use_cpu=True).memory.compute_dtype == "bfloat16" and not run(use_cpu=True).notes
    assert run(bf16=False).memory.compute_dtype is None and not run(bf16=False).notes
    assert run(fp16=True).memory.compute_dtype == "float16"
    plan = run(device_bf16=True, model_init_kwargs={"dtype": "bfloat16"}).memory
    assert (plan.dtype, plan.compute_dtype) == ("bfloat16", None)
    assert run(optim="adamw_8bit", bf16=False).memory.optimizer == "adamw8bit"


def _changed(value):
    """A value other than ``value`` of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, list):
        return [*value, "other"]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return 7


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_field_names_itself_why_and_the_nearest(name):
    value = _changed(getattr(GRPOConfig(), name))
    with pytest.raises(TRLSettingError) as caught:
        run(**{name: value})
    (field, message), = [p for p in caught.value.problems if p[0] == name]
    why, nearest = REFUSED[name]
    assert message == f"{name}={value!r}: {why}; nearest: {nearest}"
    assert f"  - {message}" in str(caught.value)


@pytest.mark.parametrize("kwargs, field, words", [
    ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "importance_sampling_level", "'grpo'"),
    ({"loss_type": "reinforce"}, "loss_type", "loss_type='dapo'"),
    ({"loss_type": "sapo", "beta": 0.04}, "beta", "use_bias_correction_kl=False"),
    ({"loss_type": "sapo", "delta": 2.0}, "delta", "loss_type='dapo'"),
    ({"loss_type": "bnpo", "gradient_accumulation_steps": 2}, "loss_type", "loss_type='dapo'"),
    ({"loss_type": "cispo"}, "epsilon_high", "epsilon_high=5.0"),
    ({"beta": 0.04, "loss_type": "cispo", "epsilon_high": 5.0}, "beta", "use_bias_correction_kl=False"),
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level", "loss_type='grpo'"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "lr_scheduler_type", "'linear'"),
    ({"optim": "sgd"}, "optim", "adamw_torch"), ({"save_strategy": "best"}, "save_strategy", "'steps'"),
    ({"report_to": "mlflow"}, "report_to", "tensorboard"),
    ({"max_completion_length": None}, "max_completion_length", "512"),
    ({"model_init_kwargs": {"attn_implementation": "sdpa"}}, "model_init_kwargs", "'dtype'"),
    ({"loss_type": "grpo", "mask_truncated_completions": True}, "mask_truncated_completions", "'dapo'"),
    ({"multi_objective_aggregation": "mean"}, "multi_objective_aggregation", "'sum_then_normalize'"),
    ({"entropy_coef": 0.01, "loss_type": "grpo"}, "entropy_coef", "loss_type='dapo'"),
    ({"entropy_coef": 0.01, "loss_type": "sapo"}, "entropy_coef", "loss_type='dapo'"),
    ({"entropy_coef": -0.01}, "entropy_coef", "entropy_coef > 0"),
    ({"use_adaptive_entropy": True, "gradient_accumulation_steps": 2}, "use_adaptive_entropy",
     "gradient_accumulation_steps=1"),
    ({"entropy_coef": 0.01, "top_entropy_quantile": 0.5}, "entropy_coef", "top_entropy_quantile=1.0"),
    ({"use_adaptive_entropy": True, "num_iterations": 2}, "use_adaptive_entropy", "num_iterations=1"),
    ({"use_adaptive_entropy": True, "entropy_coef": 2.0}, "use_adaptive_entropy", "entropy_coef_max"),
    ({"off_policy_mask_threshold": 0.5, "loss_type": "cispo", "epsilon_high": 5.0},
     "off_policy_mask_threshold", "loss_type='dapo'"),
    ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold", "None (off)"),
    ({"use_vllm": True, "loss_type": "vespo", "vllm_importance_sampling_mode": "token_mask",
      "vllm_importance_sampling_clip_min": 0.5}, "vllm_importance_sampling_clip_min", "None"),
    ({"use_vllm": True, "vllm_importance_sampling_mode": "token_mask",
      "vllm_importance_sampling_clip_max": None}, "vllm_importance_sampling_clip_max", "3.0"),
    ({"sync_ref_model": True}, "sync_ref_model", "beta > 0"),
    ({"sync_ref_model": True, "beta": 0.04, "num_iterations": 2, "ref_model_sync_steps": 5},
     "ref_model_sync_steps", "a positive multiple of 2"),
    ({"sync_ref_model": True, "beta": 0.04, "ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha", "0.6"),
])
def test_settings_without_an_equivalent_are_refused_by_name(kwargs, field, words):
    with pytest.raises(TRLSettingError) as caught:
        run(**kwargs)
    assert [p[0] for p in caught.value.problems] == [field] and words in caught.value.problems[0][1]


def test_every_problem_comes_in_one_error():
    with pytest.raises(TRLSettingError, match=r"^3 TRL setting\(s\)") as caught:
        run(loss_type="bnpo", gradient_accumulation_steps=2, vllm_group_port=1, log_unique_prompts=True)
    assert sorted(p[0] for p in caught.value.problems) == ["log_unique_prompts", "loss_type",
                                                           "vllm_group_port"]


def test_the_constructor_takes_every_parameter_of_trls():
    trl = _trl()
    theirs = list(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert theirs == ours


def _reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


@pytest.mark.parametrize("argument, value", [
    ("reward_funcs", "some/reward-model"), ("reward_processing_classes", object()),
    ("optimizers", (object(), None)), ("quantization_config", object()), ("rollout_func", print),
    ("callbacks", [object()]), ("eval_dataset", {"a": [], "b": []}), ("environment_factory", {"a": object})])
def test_trainer_arguments_without_an_equivalent_are_refused(argument, value, tiny_folder, tmp_path):
    kwargs = {"reward_funcs": _reward_len, argument: value}
    with pytest.raises(TRLSettingError) as caught:
        GRPOTrainer(str(tiny_folder), args=GRPOConfig(str(tmp_path), bf16=False, max_completion_length=8),
                    train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), **kwargs)
    assert [p[0] for p in caught.value.problems] == [argument] and "nearest" in str(caught.value)


def _trl_script(name: str, changes: dict[str, str]) -> str:
    """The TRL script ``name`` as docs/from_trl.md prints it, ``from trl import`` pointed at grpo_engine.trl
    and each of ``changes`` (a hub name, a folder) made once: nothing else of the script changes."""
    text = (DOCS / "from_trl.md").read_text()
    marker = f'<!-- not run: TRL script "{name}", run by tests/test_trl_entry.py through grpo_engine.trl -->'
    code = re.search(re.escape(marker) + r"\n```python\n(.*?)```", text, re.DOTALL).group(1)
    changes = {"from trl import": "from grpo_engine.trl import", **changes}
    for old, new in changes.items():
        assert code.count(old) == 1, (name, old)
        code = code.replace(old, new)
    return code


def _run_script(name: str, changes: dict[str, str], namespace: dict | None = None) -> dict:
    namespace = dict(namespace or {})
    exec(compile(_trl_script(name, changes), f"docs/from_trl.md ({name})", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def long_tiny_folder(tmp_path_factory):
    """The tiny model with room for TRL's 512-token default completions and for tool schemas in the
    prompt (each character is a token): a 2,048-token context."""
    from tests.tiny import char_tokenizer, tiny_llama

    folder = tmp_path_factory.mktemp("tiny-2k")
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    model.config.max_position_embeddings = 2048
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trls_length_reward_quickstart_runs_with_its_import_line_changed(tiny_folder, tmp_path):
    """TRL's earlier quick start (trl-lib/tldr, a length reward): the dataset, model id and output folder
    point at local ones; TRL's run is 3 epochs of 2 prompts, one prompt a step."""
    namespace = _run_script("length reward", {
        'load_dataset("trl-lib/tldr", split="train")': "DATASET",
        '"Qwen/Qwen2-0.5B-Instruct"': json.dumps(str(tiny_folder)),
        'output_dir="Qwen2-0.5B-GRPO"': f"output_dir={str(tmp_path / 'run')!r}"},
        {"DATASET": Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4"]})})
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 6 and (tmp_path / "run" / "final").is_dir()
    assert trainer.native.config.group_size == 8 and trainer.native.config.max_completion_tokens == 64
    assert trainer.native.scheduler.get_last_lr()[0] == 0.0  # TRL's linear decay reached its end


def test_trls_quick_start_runs_with_its_import_line_changed(long_tiny_folder, tmp_path, monkeypatch):
    """TRL 1.16's quick start: conversational prompts (a system turn) with a ``solution`` column, scored by
    ``trl.rewards.accuracy_reward``, no GRPOConfig: TRL's defaults (512-token completions, 8 a prompt, 3
    epochs) and TRL's output folder, the model's name + "-GRPO" in the working directory."""
    pytest.importorskip("trl.rewards")
    monkeypatch.chdir(tmp_path)
    system = {"role": "system", "content": "Put the final answer in \\boxed{}."}
    rows = [{"prompt": [system, {"role": "user", "content": "What is 1+1?"}], "solution": "$2$"},
            {"prompt": [system, {"role": "user", "content": "What is 2*3?"}], "solution": "$6$"}]
    namespace = _run_script("quick start", {
        'load_dataset("trl-lib/DeepMath-103K", split="train")': "DATASET",
        '"Qwen/Qwen2-0.5B-Instruct"': json.dumps(str(long_tiny_folder))},
        {"DATASET": Dataset.from_list(rows)})
    trainer = namespace["trainer"]
    native = trainer.native.config
    assert trainer.state.global_step == 6 and (native.group_size, native.max_completion_tokens) == (8, 512)
    assert Path(trainer.args.output_dir) == Path(f"{long_tiny_folder.name}-GRPO")
    assert (tmp_path / trainer.args.output_dir / "final").is_dir()
    assert trainer.native.rewards.names == ("accuracy_reward",)


def test_the_readmes_trl_example_is_the_tested_quick_start():
    """README's "Coming from TRL?" block is docs/from_trl.md's quick start with only its import line changed,
    the code the test above runs."""
    readme = (DOCS.parent / "README.md").read_text()
    marker = ("<!-- not run: from_trl.md's \"quick start\", import line changed; tests/test_trl_entry.py "
              "runs it -->")
    shown = re.search(re.escape(marker) + r"\n```python\n(.*?)```", readme, re.DOTALL).group(1)
    assert shown == _trl_script("quick start", {})


def test_trls_custom_reward_reading_a_solution_column_runs_as_written(tiny_folder, tmp_path):
    """TRL's "Using a custom reward function": text prompts, the function takes the ``solution`` column by
    name (a missing column would stop the run: rewards raise by default); each step logs its score."""
    out = tmp_path / "run"
    namespace = _run_script("reference column", {
        '"Qwen/Qwen2-0.5B-Instruct"': json.dumps(str(tiny_folder)),
        'output_dir="Qwen2-0.5B-GRPO"': f"output_dir={str(out)!r}"})
    assert namespace["trainer"].state.global_step == 6  # 3 epochs of 2 prompts
    records = _records(out)
    assert len(records) == 6 and all("reward/boxed_solution_reward/mean" in r for r in records)
    reward = namespace["boxed_solution_reward"]
    assert reward(completions=["so \\boxed{2}", "\\boxed{4}"], solution=["2", "5"]) == [1.0, 0.0]


def _tools_of(trainer) -> list[str]:
    return [schema["function"]["name"] for schema in trainer.native.sampler.schemas]


def test_trls_tools_example_runs_with_its_import_line_changed(long_tiny_folder, tmp_path):
    """TRL's "Agent Training": ``tools=[multiply, add]`` (``add`` async), conversational prompts; the rollouts
    offer both tools, and TRL's ``max_tool_calling_iterations=2`` is 3 model turns."""
    out = tmp_path / "run"
    namespace = _run_script("tools", {
        '"Qwen/Qwen3-0.6B"': json.dumps(str(long_tiny_folder)),
        'output_dir="Qwen3-0.6B-GRPO"': f"output_dir={str(out)!r}"})
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 6 and (out / "final").is_dir()
    assert _tools_of(trainer) == ["multiply", "add"] and trainer.native.sampler.max_turns == 3


def test_trls_environment_factory_example_runs_with_its_import_line_changed(long_tiny_folder, tmp_path):
    """TRL's ``environment_factory``: one CounterEnv per rollout, its public method ``increment`` the only
    tool (not ``reset``), the reward reads ``environments`` and the ``goal`` column."""
    out = tmp_path / "run"
    namespace = _run_script("environment", {
        '"Qwen/Qwen3-0.6B"': json.dumps(str(long_tiny_folder)),
        'output_dir="Qwen3-0.6B-GRPO"': f"output_dir={str(out)!r}"})
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 6 and (out / "final").is_dir()
    assert _tools_of(trainer) == ["increment"] and trainer.native.sampler.environment_factory is \
        namespace["CounterEnv"]


def _args(tmp_path, **kwargs):
    return GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, bf16=False, gradient_checkpointing=False, logging_steps=1,
                      disable_tqdm=True, **kwargs)


def test_resume_from_checkpoint_continues_the_run_exactly(tiny_folder, tmp_path):
    data = Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4", "Sum 5 and 6"]})
    args = _args(tmp_path, max_steps=3, save_steps=1, learning_rate=1e-3, warmup_steps=1)
    first = GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data)
    whole = first.train()
    with pytest.raises(FileExistsError, match=r"train\(resume_from_checkpoint=True\) continues that run"):
        GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data).train()  # TRL writes over it
    resumed = GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data)
    out = resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert out.global_step == 3 and resumed.native.scheduler.last_epoch == 3
    assert out.metrics["lr"] == whole.metrics["lr"] == pytest.approx(1e-3 / 2)  # linear: (3 - 2) / (3 - 1)
    assert out.metrics["loss"] == pytest.approx(whole.metrics["loss"], abs=1e-7)
    assert out.metrics["reward/mean"] == whole.metrics["reward/mean"]


def test_a_prompt_over_the_context_is_named_in_trls_terms(tiny_folder, tmp_path):
    """The tiny model's context is 256 tokens: 200 for completions leave 56 for a prompt."""
    from grpo_engine.data.errors import DataError

    data = Dataset.from_dict({"prompt": ["Sum 1 and 2", "x" * 100]})
    args = _args(tmp_path, max_steps=1)
    args.max_completion_length = 200
    with pytest.raises(DataError, match=r"100 tokens > max_prompt_tokens=56.*With TRL's entry prompts are "
                                        r"never cut.*max_completion_length=200 \(56 tokens\)"):
        GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data)
    args.max_completion_length = 256
    with pytest.raises(TRLSettingError, match="max_completion_length=256: the model's context is 256 tokens"):
        GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data)


def test_log_completions_writes_the_steps_completions(tiny_folder, tmp_path):
    args = _args(tmp_path, max_steps=2, log_completions=True, num_completions_to_print=1)  # logging_steps=1
    data = Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4"]})
    GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 1, 2, 2]
    assert rows[0]["prompt"] in ("Sum 1 and 2", "Sum 3 and 4")
    for row in rows:
        assert row["reward"] == row["_reward_len"] == -abs(20 - len(row["completion"]))


def test_eval_dataset_is_evaluated_every_eval_steps_and_save_model_writes_the_policy(tiny_folder, tmp_path):
    data = Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4"], "answer": ["3", "7"]})
    args = _args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, beta=0.04)  # a reference
    trainer = GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data, eval_dataset=data,
                          callbacks=[Callback()])
    trainer.train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert ["eval/pass@1" in line for line in lines] == [False, True] and "kl" in lines[0]
    folder = trainer.save_model(str(tmp_path / "saved"))
    assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    assert trainer.evaluate() == {"eval/pass@1": lines[1]["eval/pass@1"]}  # greedy, unchanged policy
    trainer.save_metrics("train", {"train_loss": 0.5})
    saved = json.loads(trainer.save_state().read_text())
    assert json.loads((tmp_path / "run" / "all_results.json").read_text()) == {"train_loss": 0.5}
    assert saved["global_step"] == 2 and len(saved["log_history"]) == 2


def test_the_schedule_is_transformers_and_a_resumed_one_starts_where_it_was():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = Schedule("linear", warmup_steps=2, total_steps=4)
    lrs = []
    scheduler = trl_scheduler(optimizer, schedule)
    for _ in range(4):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == [0.0, 0.5, 1.0, 0.5]  # transformers' warm-up starts at 0, unlike the native (step+1)/(w+1)
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert trl_scheduler(fresh, schedule, start=3).get_last_lr()[0] == 0.5


def test_push_to_hub_saves_the_hub_layout_then_uploads_it(tiny_folder, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo",
                        lambda repo_id, **kw: calls.append(("create", repo_id, kw)))
    monkeypatch.setattr(huggingface_hub, "upload_folder",
                        lambda **kw: calls.append(("upload", kw)) or "commit")
    args = _args(tmp_path, max_steps=1, save_steps=1, push_to_hub=True, hub_model_id="me/tiny-grpo",
                 hub_private_repo=True)
    data = Dataset.from_dict({"prompt": ["a", "b"]})
    GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data).train()
    (_, repo, created), (_, upload) = calls
    run = tmp_path / "run"
    assert (repo, created["private"], upload["repo_id"], upload["folder_path"]) == ("me/tiny-grpo", True,
                                                                                   "me/tiny-grpo", str(run))
    assert {"checkpoint-*", "final/*"} <= set(upload["ignore_patterns"])
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md"} <= {
        p.name for p in run.iterdir()}


def test_an_offline_push_fails_with_the_reason_and_loses_nothing(tiny_folder, tmp_path, monkeypatch):
    import huggingface_hub

    from grpo_engine.trl.hub import HubPushError

    def offline(*args, **kwargs):
        raise ConnectionError("no network: huggingface.co could not be reached")

    monkeypatch.setattr(huggingface_hub, "create_repo", offline)
    args = _args(tmp_path, max_steps=2, save_steps=1, push_to_hub=True)
    trainer = GRPOTrainer(str(tiny_folder), _reward_len, args,
                          train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}))
    with pytest.raises(HubPushError, match=r"failed: ConnectionError: no network.*Nothing saved is lost.*"
                                           r"huggingface_hub.upload_folder\(repo_id='run'") as caught:
        trainer.train()
    run = tmp_path / "run"
    assert caught.value.folder == run and (run / "model.safetensors").is_file()
    assert {p.name for p in run.iterdir()} >= {"checkpoint-1", "checkpoint-2", "final", "metrics.jsonl"}
    assert trainer.state.global_step == 2 and (run / "final" / "model.safetensors").is_file()


def test_use_vllm_becomes_the_vllm_sampler_and_its_correction():
    r = run(use_vllm=True, vllm_gpu_memory_utilization=0.5, vllm_enable_sleep_mode=True,
            max_completion_length=64, vllm_max_model_length=1024)
    assert r.vllm == VLLMPlan("colocate", {"gpu_memory_utilization": 0.5, "sleep_between_steps": True,
                                           "engine_kwargs": {}})
    assert (r.loss.tis_cap, r.loss.tis_mode, r.config.max_prompt_tokens) == (3.0, "sequence_mask", 1024 - 64)
    server = run(use_vllm=True, vllm_mode="server", vllm_server_port=8100)
    assert server.vllm == VLLMPlan("server", {"base_url": "http://0.0.0.0:8100"})
    assert "server_command" in " ".join(server.notes)
    assert run(use_vllm=True, vllm_importance_sampling_correction=False).loss.tis_cap is None
    bounded = run(use_vllm=True, vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=5.0,
                  vllm_importance_sampling_mode="token_mask").loss  # IcePop's bounds
    assert (bounded.tis_cap_min, bounded.tis_cap, bounded.tis_mode) == (0.5, 5.0, "token_mask")
    low_only = run(use_vllm=True, vllm_importance_sampling_clip_min=0.5,
                   vllm_importance_sampling_clip_max=None, vllm_importance_sampling_mode="token_mask").loss
    assert (low_only.tis_cap_min, low_only.tis_cap) == (0.5, None)
    vespo = run(use_vllm=True, loss_type="vespo", vllm_importance_sampling_mode="token_mask").loss
    assert (type(vespo).__name__, vespo.tis_cap, vespo.tis_mode) == ("VESPO", 3.0, "token_mask")
    with pytest.raises(TRLSettingError, match="vllm_importance_sampling_mode='sequence_mask': loss_type="):
        run(use_vllm=True, loss_type="vespo")  # TRL's default mode is sequence_mask, which TRL refuses too
    assert run(vllm_gpu_memory_utilization=0.5).vllm is None  # without use_vllm TRL ignores them too


def test_a_vllm_run_builds_the_server_sampler_or_says_what_is_missing(tiny_folder, tmp_path):
    from grpo_engine.sampling.vllm_server import VLLMServerSampler

    data = Dataset.from_dict({"prompt": ["a", "b"]})
    args = _args(tmp_path, max_steps=1, use_vllm=True, vllm_mode="server",
                 vllm_server_base_url="http://127.0.0.1:8123")
    trainer = GRPOTrainer(str(tiny_folder), _reward_len, args, train_dataset=data)
    sampler = trainer.native.sampler
    assert isinstance(sampler, VLLMServerSampler) and sampler.base_url == "http://127.0.0.1:8123"
    assert (sampler.max_completion_tokens, trainer.native.loss.tis_cap) == (4, 3.0)
    try:  # the colocated engine needs vllm
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="VLLMSampler needs vLLM: pip install"):
            GRPOTrainer(str(tiny_folder), _reward_len, _args(tmp_path, max_steps=1, use_vllm=True),
                        train_dataset=data)


@pytest.mark.parametrize("as_object", [False, True])
def test_peft_config_trains_an_adapter_and_resumes(as_object, tiny_folder, tmp_path):
    """A LoraConfig becomes the plan's LoRA; a resumed run (from the name, or from a model object whose
    adapters are taken out and put back) continues the saved one exactly."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4"]})
    args = _args(tmp_path, max_steps=2, save_steps=1, learning_rate=1e-2)

    def trainer():
        model = AutoModelForCausalLM.from_pretrained(tiny_folder) if as_object else str(tiny_folder)
        tokenizer = AutoTokenizer.from_pretrained(tiny_folder) if as_object else None
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        return GRPOTrainer(model, _reward_len, args, train_dataset=data, processing_class=tokenizer,
                           peft_config=lora)

    first = trainer()
    assert type(first.model).__name__.startswith("Peft") and first.native.memory.lora.r == 4
    whole = first.train()
    assert (tmp_path / "run" / "checkpoint-1" / "adapter_config.json").is_file()
    resumed = trainer()
    out = resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    assert out.global_step == 2 and out.metrics["loss"] == pytest.approx(whole.metrics["loss"], abs=1e-6)
    saved = dict(first.model.named_parameters())
    for name, value in resumed.model.named_parameters():
        if "lora_" in name:
            assert torch.allclose(value, saved[name], atol=1e-6), name


@pytest.mark.parametrize("kwargs, prompts", [
    ({"num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
      "num_iterations": 2, "num_train_epochs": 1.5}, 10),
    ({"num_generations": 8}, 7),
    ({"num_generations": 2, "per_device_train_batch_size": 6, "num_train_epochs": 2.3}, 11),
    ({"num_generations": 4, "per_device_train_batch_size": 4, "num_iterations": 3, "num_train_epochs": 1},
     9)])
def test_epochs_count_the_steps_trls_trainer_counts(kwargs, prompts, tiny_folder, tmp_path):
    """max_steps=-1: TRL's trainer's own dataloader and transformers' rule give its optimizer steps; the
    native run takes ceil(those / num_iterations) generation batches."""
    trl = _trl()
    data = Dataset.from_dict({"prompt": [f"p{i}" for i in range(prompts)]})
    args = trl.GRPOConfig(str(tmp_path / "trl"), use_cpu=True, report_to="none", max_completion_length=4,
                          **kwargs)
    batches = len(trl.GRPOTrainer(model=str(tiny_folder), reward_funcs=_reward_len, args=args,
                                  train_dataset=data).get_train_dataloader())
    accumulation = args.gradient_accumulation_steps
    trl_steps = math.ceil(args.num_train_epochs * max(1, math.ceil(batches / accumulation)))
    ours = run(num_prompts=prompts, output_dir=str(tmp_path / "ours"), max_completion_length=4, **kwargs)
    assert ours.config.max_steps == math.ceil(trl_steps / args.num_iterations)


def test_trls_own_grpo_script_runs_with_its_import_lines_changed(tiny_folder, tmp_path, monkeypatch, capsys):
    """trl/scripts/grpo.py (TRL's `trl grpo`), its two imports of GRPOConfig and GRPOTrainer pointed here:
    parsed by TRL's TrlParser, trained, saved, with TRL's own think_format_reward."""
    trl = _trl()
    source = Path(trl.__file__).parent / "scripts" / "grpo.py"
    code = source.read_text()
    changes = {"from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config":
               "from trl import get_dataset, get_peft_config, get_quantization_config\n"
               "    from grpo_engine.trl import GRPOTrainer",
               "from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser":
               "from trl import DatasetMixtureConfig, ModelConfig, TrlParser\n"
               "    from grpo_engine.trl import GRPOConfig"}
    for old, new in changes.items():
        assert code.count(old) == 1
        code = code.replace(old, new)
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"Sum {a} and {b}"}]} for a, b in [(1, 2), (3, 4)]]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    argv = ["grpo.py", "--model_name_or_path", str(tiny_folder), "--dataset_name", str(data),
            "--reward_funcs", "think_format_reward", "--output_dir", str(out), "--max_steps", "2",
            "--num_generations", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "8"]
    monkeypatch.setattr("sys.argv", argv)
    exec(compile(code, str(source), "exec"), {"__name__": "__main__"})
    assert "Training completed" in capsys.readouterr().out
    assert (out / "final").is_dir() and (out / "model.safetensors").is_file()


def test_prompts_are_tokenised_as_trl_tokenises_them(tiny_folder, tmp_path):
    """TRL: a text prompt is tokenised as it is (no template), a conversational one through the chat
    template with the generation prompt; the native default would wrap text in a user turn."""
    from grpo_engine.types import Prompt

    data = Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4"]})
    trainer = GRPOTrainer(str(tiny_folder), _reward_len, _args(tmp_path, max_steps=1), train_dataset=data)
    tokenizer, sampler = trainer.processing_class, trainer.native.sampler
    assert sampler.prompt_tokens(Prompt("Sum 1 and 2")) == tokenizer(text=["Sum 1 and 2"])["input_ids"][0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum 1 and 2"}]
    theirs = tokenizer.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"][0]
    assert sampler.prompt_tokens(Prompt(messages)) == list(theirs)


def test_conversational_data_with_trls_own_reward_functions(tiny_folder, tmp_path):
    """TRL's usual math script: message prompts with a system turn and a ``solution`` column, scored by
    ``trl.rewards.accuracy_reward`` and ``think_format_reward`` as they are: each reads
    ``completion[0]["content"]``; the unparseable gold answer is None, counted and left out."""
    trl_rewards = pytest.importorskip("trl.rewards")
    system = {"role": "system", "content": "Think, then answer in \\boxed{}."}
    rows = [{"prompt": [system, {"role": "user", "content": "1+1?"}], "solution": "$2$"},
            {"prompt": [system, {"role": "user", "content": "Name a colour."}], "solution": "red or blue"}]
    trainer = GRPOTrainer(str(tiny_folder), [trl_rewards.accuracy_reward, trl_rewards.think_format_reward],
                          args=_args(tmp_path, max_steps=2), train_dataset=Dataset.from_list(rows))
    trainer.train()  # one prompt x 2 completions a step: both prompts, one each
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/accuracy_reward/mean" in r for r in records)
    assert sorted(r.get("reward/accuracy_reward/none", 0.0) for r in records) == [0.0, 2.0]  # no gold
    assert all(r["reward/think_format_reward/mean"] == 0.0 for r in records)  # a random model never thinks


class _ScoredEnv:
    """An environment that owns its reward (TRL 1.16's ``get_reward``): 0.25 a rollout after ``reset``."""

    def reset(self, **kwargs) -> None:
        self.score = 0.25

    def step(self, move: int) -> int:
        """Makes a move.

        Args:
            move: the move.
        """
        return move

    def get_reward(self) -> float:
        return self.score


class _AsyncScoredEnv(_ScoredEnv):
    async def get_reward(self) -> float:
        return self.score


@pytest.mark.parametrize("env", [_ScoredEnv, _AsyncScoredEnv])
def test_an_environment_that_owns_its_reward_is_one_more_reward_and_never_a_tool(env, long_tiny_folder,
                                                                                   tmp_path):
    """As TRL 1.16: ``get_reward`` (sync or async) scores each rollout under the class's name with weight 1,
    ``reward_funcs`` may then be left out, and the model is never offered ``get_reward`` as a tool."""
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Move {n}."}] for n in (1, 2)]})
    trainer = GRPOTrainer(str(long_tiny_folder), args=_args(tmp_path, max_steps=1), train_dataset=data,
                          environment_factory=env)
    assert trainer.native.rewards.names == (env.__name__,) and _tools_of(trainer) == ["step"]
    trainer.train()
    (record,) = _records(tmp_path / "run")
    assert record[f"reward/{env.__name__}/mean"] == 0.25 and record["reward/mean"] == 0.25


def test_an_async_reward_function_is_awaited(tiny_folder, tmp_path):
    """TRL 1.16's asynchronous reward functions (``async def``): awaited, their scores used as a plain
    function's, next to a plain one."""
    import asyncio

    async def slow_reward(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5 for _ in completions]

    data = Dataset.from_dict({"prompt": ["Sum 1 and 2", "Sum 3 and 4"]})
    GRPOTrainer(str(tiny_folder), [slow_reward, _reward_len], _args(tmp_path, max_steps=1),
                train_dataset=data).train()
    (record,) = _records(tmp_path / "run")
    assert record["reward/slow_reward/mean"] == 0.5 and "reward/_reward_len/mean" in record
