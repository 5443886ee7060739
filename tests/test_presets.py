"""Presets return the paper's components, and each one trains a step end to end."""

import pytest
import torch

from grpo_engine import presets
from grpo_engine.advantages import RLOO, GroupNormalized, MeanBaseline
from grpo_engine.losses import CISPO, GSPO, ClippedSurrogate, KLPenalty
from grpo_engine.rewards import OverlongPenalty
from grpo_engine.sampling import DynamicSampling
from grpo_engine.types import MicroBatch
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare
from tests.tiny import char_tokenizer, tiny_llama


def test_each_preset_sets_what_its_paper_sets():
    g = presets.grpo()
    assert g.advantage == GroupNormalized()
    assert g.loss == ClippedSurrogate(aggregation="sequence", terms=(KLPenalty(0.04, "k3"),))
    flat = ClippedSurrogate(kl_coef=0.04, aggregation="sequence")  # the same loss from the keyword arguments
    assert g.loss.requires == flat.requires
    torch.manual_seed(0)
    logp, old, ref = (-torch.rand(3, 5, dtype=torch.float64, requires_grad=True), -torch.rand(3, 5),
                      -torch.rand(3, 5))
    mb = MicroBatch(completion_mask=torch.rand(3, 5) > 0.3, advantages=torch.randn(3), old_logprobs=old,
                    ref_logprobs=ref)
    counts = dict(num_valid_tokens=int(mb.completion_mask.sum()), num_sequences=3)
    assert torch.equal(g.loss(logp, mb, **counts).loss, flat(logp, mb, **counts).loss)
    d = presets.dr_grpo(256)
    assert d.advantage == MeanBaseline()
    assert d.loss == ClippedSurrogate(aggregation="constant", max_completion_tokens=256)
    dapo = presets.dapo(256, 64)
    assert dapo.loss == ClippedSurrogate(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token")
    assert dapo.sampler == DynamicSampling(max_rounds=3, key="math_accuracy")
    assert dapo.components()["sampler"] is dapo.sampler and "sampler" not in d.components()
    assert isinstance(dapo.extra_rewards[0], OverlongPenalty)
    assert presets.gspo().loss == GSPO(clip_eps_low=3e-4, clip_eps_high=4e-4)
    assert presets.cispo().loss == CISPO(clip_eps_high=4.0)
    assert presets.rloo().advantage == RLOO() and presets.rloo().loss.aggregation == "token"


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo"])
def test_each_preset_runs_a_step(tmp_path, name):
    from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan

    special = {"dr_grpo": lambda: presets.dr_grpo(8),
               "dapo": lambda: presets.dapo(8, 4, accuracy_key="digit_share")}
    recipe = special.get(name, getattr(presets, name))()
    tokenizer = char_tokenizer()
    trainer = GRPOTrainer(
        tiny_llama(len(tokenizer)), [DigitShare(), *recipe.extra_rewards], PROMPTS, tokenizer=tokenizer,
        template=TEMPLATE, memory=MemoryPlan(lora=LoRA(r=2, alpha=4)), **recipe.components(),
        config=GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=1,
                          output_dir=str(tmp_path), progress_bar=False),
    )
    metrics = trainer.step()
    assert metrics["grad_norm"] >= 0.0 and "clip_fraction" in metrics
    assert ("kl" in metrics) == (name == "grpo")
