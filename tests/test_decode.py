"""The decoding loop: exact categorical draws, greedy ids equal to transformers' generate, rows that
leave the batch at their EOS, a shared prompt prefill, and the generate() fallback."""

import pytest
import torch
from torch import nn

from grpo_engine.data import PlainTemplate
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.sampling import decode as decode_module
from grpo_engine.sampling.decode import BLOCK, TokenDraw, decode, inverse_cdf, sample_categorical
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.types import Prompt

from .tiny import char_tokenizer, tiny_llama

# -- the categorical draw -------------------------------------------------------------------------


def test_inverse_cdf_hand_cases():
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0]] * 4)
    # running sums 0, 1, 1, 4: u * 4 = 0.4 and 4.0 * 0.25 = 1 land on index 1; 1.2 and 4 on index 3
    assert inverse_cdf(weights, torch.tensor([0.1, 0.25, 0.3, 1.0])).tolist() == [1, 1, 3, 3]
    # a weight far below float32's resolution of the running sum still has its own interval
    tiny = torch.tensor([[1.0, 1e-9]])
    assert inverse_cdf(tiny, torch.tensor([1.0])).tolist() == [1]
    assert inverse_cdf(tiny, torch.tensor([1.0 - 2e-9], dtype=torch.float64)).tolist() == [0]


def test_sample_categorical_matches_the_probabilities_and_never_draws_a_zero():
    torch.manual_seed(0)
    vocab = 2 * BLOCK + 88  # three blocks, the last padded
    probs = torch.zeros(vocab)
    probs[[0, 5, BLOCK - 1, BLOCK, 300, vocab - 2]] = torch.tensor([0.3, 0.1, 0.15, 0.05, 0.25, 0.15])
    probs[vocab - 1] = 0.0  # zero at both ends and beside every drawn id
    # unnormalised
    draws = torch.cat([sample_categorical(probs.expand(20_000, vocab) * 7.0) for _ in range(10)])
    counts = torch.bincount(draws, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * len(draws)
    sigma = (expected * (1 - probs.double())).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1e-9).all(), (counts[probs > 0], expected[probs > 0])


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")])
def test_sample_categorical_rejects_a_row_without_a_distribution(bad):
    probs = torch.full((2, 5), 0.2)
    probs[1] = bad
    with pytest.raises(ValueError, match="sums to zero or holds NaN/inf"):
        sample_categorical(probs)


def test_first_tokens_follow_the_temperature_scaled_distribution():
    """The sampler's first token, over 12,000 rows of one prompt, against softmax(logits / T)."""
    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # a peaked distribution: a few ids carry most of the mass
    sampler = HFSampler(model, tok, template=PlainTemplate("{question}"), max_completion_tokens=1,
                        temperature=0.7)
    torch.manual_seed(0)
    batch = sampler.sample([Prompt("12+", "x")], group_size=12_000)
    ids, mask = sampler.encode_prompts([Prompt("12+", "x")])
    with torch.no_grad():
        probs = torch.softmax(
            model(input_ids=ids, attention_mask=mask.long()).logits[0, -1].double() / 0.7, -1)
    counts = torch.bincount(batch.completion_ids[:, 0], minlength=len(probs)).double()
    expected = probs * 12_000
    assert probs.max() < 0.9 and (probs > 0.01).sum() >= 3  # the test can tell distributions apart
    assert ((counts - expected).abs() <= 5 * (expected * (1 - probs)).sqrt() + 2).all()


def test_top_k_and_top_p_draw_only_the_kept_ids_and_report_untruncated_logprobs():
    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    prompt = Prompt("12+", "x")
    ids, mask = HFSampler(model, tok, template=PlainTemplate("{question}")).encode_prompts([prompt])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids, attention_mask=mask.long()).logits[0, -1] / 0.7, -1)
    order = probs.argsort(descending=True)
    nucleus = int((probs[order].cumsum(0) < 0.6).sum()) + 1  # the fewest ids whose mass reaches 0.6
    for kw, kept in ((dict(top_k=3), order[:3]), (dict(top_p=0.6), order[:nucleus])):
        sampler = HFSampler(model, tok, template=PlainTemplate("{question}"), max_completion_tokens=1,
                            temperature=0.7, **kw)
        torch.manual_seed(0)
        batch = sampler.sample([prompt], group_size=2000)
        drawn = set(batch.completion_ids[:, 0].tolist())
        assert drawn <= set(kept.tolist()) and len(drawn) >= 2, (kw, drawn)
        expected = probs.log()[batch.completion_ids[:, 0]]  # before truncation, as the trainer computes
        torch.testing.assert_close(batch.sampler_logprobs[:, 0], expected, rtol=0, atol=1e-5)


# -- the loop -------------------------------------------------------------------------------------


GREEDY = TokenDraw(greedy=True, logprobs=False)


def prompts_and_eos(model, tok):
    """Left-padded prompts of three lengths, and an EOS id that the greedy rows reach at different steps."""
    sampler = HFSampler(model, tok, template=PlainTemplate("Q:{question}\nA:"))
    ids, mask = sampler.encode_prompts([Prompt("1+1", ""), Prompt("what is 12+30", ""), Prompt("7", "")])
    free = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=10,
                          eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
    return ids, mask, int(free[0, 2])  # row 0 ends at its third token


def test_greedy_decode_equals_generate_with_rows_leaving_at_their_eos():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask, eos = prompts_and_eos(model, tok)
    out, logprobs = decode(model, ids, mask, repeats=1, max_new_tokens=10, eos_ids=[eos], pad_id=0,
                           draw=GREEDY)
    reference = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=10,
                               eos_token_id=eos, pad_token_id=0)[:, ids.shape[1]:]
    assert logprobs is None and out.shape == (3, 10)
    assert out[0, 2] == eos and (out[0, 3:] == 0).all()  # row 0 left the batch after its EOS
    assert torch.equal(out[:, :reference.shape[1]], reference)
    assert (out[:, reference.shape[1]:] == 0).all()


def test_decode_without_row_removal_gives_the_same_ids(monkeypatch):
    """A cache that cannot drop rows: every row runs on, and what follows an EOS is blanked."""
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask, eos = prompts_and_eos(model, tok)
    pruned, _ = decode(model, ids, mask, repeats=1, max_new_tokens=10, eos_ids=[eos], pad_id=0, draw=GREEDY)
    supports = decode_module._supports
    monkeypatch.setattr(decode_module, "_supports",
                        lambda cache, m: m != "batch_select_indices" and supports(cache, m))
    kept, _ = decode(model, ids, mask, repeats=1, max_new_tokens=10, eos_ids=[eos], pad_id=0, draw=GREEDY)
    assert torch.equal(pruned, kept)


def test_a_shared_prefill_equals_one_prefill_per_row():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask, eos = prompts_and_eos(model, tok)
    shared, _ = decode(model, ids, mask, repeats=3, max_new_tokens=10, eos_ids=[eos], pad_id=0, draw=GREEDY)
    rows, _ = decode(model, ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), repeats=1,
                     max_new_tokens=10, eos_ids=[eos], pad_id=0, draw=GREEDY)
    assert torch.equal(shared, rows)
    assert torch.equal(shared[0], shared[2]) and not torch.equal(shared[0], shared[3])


class GenerateOnly(nn.Module):
    """Not a transformers model: the sampler can only call its generate()."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.generation_config = inner.generation_config

    def generate(self, **kwargs):
        return self.inner.generate(**kwargs)


def test_a_model_with_only_generate_is_sampled_through_it():
    tok = char_tokenizer()
    inner = tiny_llama(len(tok))
    sampler = HFSampler(GenerateOnly(inner), tok, template=PlainTemplate("Q:{question}\nA:"),
                        max_completion_tokens=12, temperature=0.7)
    torch.manual_seed(0)
    batch = sampler.sample([Prompt("7*8", "56"), Prompt("100-1", "99")], group_size=3)
    with torch.no_grad():
        trainer = completion_logprobs(inner, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                      batch.completion_mask, temperature=0.7)
    torch.testing.assert_close(batch.sampler_logprobs, trainer, rtol=0, atol=1e-5)
    assert len(set(batch.texts)) > 1


def test_a_cache_that_cannot_repeat_rows_gets_one_prefill_per_row(monkeypatch):
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask, eos = prompts_and_eos(model, tok)
    shared, _ = decode(model, ids, mask, repeats=2, max_new_tokens=10, eos_ids=[eos], pad_id=0, draw=GREEDY)
    supports, calls = decode_module._supports, []

    def no_repeat(cache, method):
        calls.append(method)
        return method != "batch_repeat_interleave" and supports(cache, method)

    monkeypatch.setattr(decode_module, "_supports", no_repeat)
    fallback, _ = decode(model, ids, mask, repeats=2, max_new_tokens=10, eos_ids=[eos], pad_id=0, draw=GREEDY)
    assert "batch_repeat_interleave" in calls
    assert torch.equal(shared, fallback)


def test_a_one_token_prompt_decodes_without_a_prefill():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask = torch.tensor([[7], [12]]), torch.ones(2, 1, dtype=torch.bool)
    out, _ = decode(model, ids, mask, repeats=2, max_new_tokens=6, eos_ids=[1], pad_id=0, draw=GREEDY)
    reference = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=6,
                               eos_token_id=1, pad_token_id=0)[:, 1:]
    assert torch.equal(out[::2, :reference.shape[1]], reference) and torch.equal(out[::2], out[1::2])
