"""Mixed precision (MemoryPlan.compute_dtype): float32 weights, bfloat16 autocast in every forward pass."""

import pytest
import torch

from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan
from grpo_engine.data import PlainTemplate
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.memory.apply import autocast
from tests.test_trainer import PROMPTS, DigitShare
from tests.tiny import char_tokenizer, tiny_llama


def trainer_for(tmp_path, memory, learning_rate):
    tok = char_tokenizer()
    config = GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=1,
                        learning_rate=learning_rate, output_dir=str(tmp_path), progress_bar=False)
    return GRPOTrainer(tiny_llama(len(tok)), [DigitShare()], PROMPTS, config, memory, tokenizer=tok,
                       template=PlainTemplate("{question}"))


def test_small_updates_survive_in_float32_weights_and_vanish_in_bfloat16(tmp_path):
    """An AdamW step moves each weight by about lr = 1e-6; a bfloat16 weight near 0.02 has a spacing of
    ~1e-4, so the step rounds away, while float32 master weights keep it."""
    changed = {}
    for name, memory in (("mixed", MemoryPlan(compute_dtype="bfloat16")),
                         ("bf16", MemoryPlan(dtype="bfloat16"))):
        trainer = trainer_for(tmp_path / name, memory, 1e-6)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.step()
        moved = [(p.detach() != b).float().mean().item() for p, b in zip(trainer.model.parameters(), before)]
        changed[name] = sum(moved) / len(moved)
        assert trainer.model.lm_head.weight.dtype == (torch.float32 if name == "mixed" else torch.bfloat16)
    assert changed["mixed"] > 0.9 and changed["bf16"] < 0.05, changed


def test_forward_passes_compute_in_bfloat16_and_the_sampler_agrees_with_the_trainer(tmp_path):
    trainer = trainer_for(tmp_path, MemoryPlan(compute_dtype="bfloat16"), 1e-3)
    trainer.sampler.return_logprobs = True
    with trainer._autocast():
        batch = trainer.sampler.sample(PROMPTS[:2], group_size=4)
        logprobs = completion_logprobs(trainer.model, batch.prompt_ids, batch.prompt_mask,
                                       batch.completion_ids, batch.completion_mask)
        hidden = trainer.model.model.layers[0].mlp.down_proj(torch.ones(1, 64))
    assert hidden.dtype == torch.bfloat16
    plain = completion_logprobs(trainer.model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                batch.completion_mask)
    mask = batch.completion_mask
    # sampler and trainer both compute in bfloat16: on average they agree far closer than either does with
    # float32 (a sampler outside autocast gives a ratio of 1.00; both in bfloat16, 0.37 on an AVX2-only CPU,
    # where the one-token and the whole-sequence products round differently). The largest gaps are not
    # compared: on such a CPU one token's bfloat16 gap can exceed its float32 one.
    gap_same = (batch.sampler_logprobs - logprobs)[mask].abs()
    gap_fp32 = (plain - logprobs)[mask].abs()
    assert gap_same.max() < 0.02
    assert gap_same.mean() < 0.5 * gap_fp32.mean(), (gap_same.mean(), gap_fp32.mean())


def test_mixed_precision_plans_are_checked():
    with pytest.raises(ValueError, match="mixed precision keeps float32 weights"):
        MemoryPlan(dtype="bfloat16", compute_dtype="float16")
    assert not MemoryPlan(dtype="bfloat16", compute_dtype="bfloat16").mixed_precision
    with autocast(MemoryPlan(), torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
