"""HFSampler: exact ids, EOS/truncation masks, left padding, and log-probs equal to the trainer's."""

import torch

from grpo_engine.data import PlainTemplate
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.sampling.hf import HFSampler, completion_mask_from_ids
from grpo_engine.types import Prompt


def test_completion_mask_hand_cases():
    ids = torch.tensor([[5, 1, 0, 0], [1, 7, 7, 7], [5, 6, 7, 8], [5, 9, 1, 1]])
    mask, truncated = completion_mask_from_ids(ids, [1, 9])
    assert mask.tolist() == [
        [True, True, False, False],  # EOS kept, nothing after it
        [True, False, False, False],  # EOS as the first token
        [True, True, True, True],  # no EOS: truncated
        [True, True, False, False],  # the second EOS id ends it too
    ]
    assert truncated.tolist() == [False, False, True, False]


def make_sampler(model, tokenizer, **kw):
    defaults = dict(template=PlainTemplate("Q:{question}\nA:"), max_completion_tokens=12, temperature=0.7)
    return HFSampler(model, tokenizer, **{**defaults, **kw})


def test_sample_shapes_padding_and_exact_ids(tiny_model, tokenizer):
    torch.manual_seed(0)
    prompts = [Prompt("1+1", "2"), Prompt("12+30", "42")]
    sampler = make_sampler(tiny_model, tokenizer)
    batch = sampler.sample(prompts, group_size=3)
    assert batch.num_completions == 6 and batch.prompt_ids.shape[0] == 6
    # left padding: the shorter prompt starts later, and its rows repeat G times
    short = tokenizer("Q:1+1\nA:")["input_ids"]
    assert batch.prompt_ids[0, -len(short):].tolist() == short
    assert batch.prompt_mask[0].sum() == len(short) and not batch.prompt_mask[0, 0]
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[2])
    eos = tokenizer.eos_token_id
    for row, mask, text, trunc in zip(batch.completion_ids, batch.completion_mask, batch.texts,
                                      batch.is_truncated):
        kept = row[mask].tolist()
        assert (row[~mask] == tokenizer.pad_token_id).all()
        assert bool(trunc) == (eos not in kept)
        assert kept.count(eos) <= 1 and (eos not in kept or kept[-1] == eos)
        assert text == tokenizer.decode(kept, skip_special_tokens=True)
    assert batch.row_prompts[3].target == "42"


def test_sampler_logprobs_equal_trainer_logprobs(tiny_model, tokenizer):
    """The ratio at the first update is exactly 1: both computations agree to float precision."""
    torch.manual_seed(1)
    prompts = [Prompt("7*8", "56"), Prompt("100-1", "99"), Prompt("2", "2")]
    batch = make_sampler(tiny_model, tokenizer, max_completion_tokens=16).sample(prompts, group_size=4)
    assert batch.sampler_logprobs is not None
    with torch.no_grad():
        trainer = completion_logprobs(tiny_model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                      batch.completion_mask, temperature=0.7)
    torch.testing.assert_close(batch.sampler_logprobs, trainer, rtol=0, atol=1e-5)
    assert (batch.sampler_logprobs[batch.completion_mask] < 0).all()


def test_same_seed_same_samples(tiny_model, tokenizer):
    sampler = make_sampler(tiny_model, tokenizer)
    torch.manual_seed(3)
    a = sampler.sample([Prompt("1+2", "3")], group_size=4)
    torch.manual_seed(3)
    b = sampler.sample([Prompt("1+2", "3")], group_size=4)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
