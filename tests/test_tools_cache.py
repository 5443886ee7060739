"""The KV cache kept across turns (issue 54): the same tokens, log-probs and ends as prefilling every context
whole, prefill counts computed by hand, the stop test's stopping points, and the cache freed."""

from __future__ import annotations

import pytest
import torch

from grpo_engine.sampling.hf import HFSampler
from grpo_engine.sampling.turn_decode import CachedTurns, StopCheck, keeps_cache
from grpo_engine.tools import ToolSampler
from grpo_engine.types import Draws, Prompt
from tests.test_tools import TEMPLATE, turn_taking_model
from tests.tiny import char_tokenizer

# prompts of different lengths: the contexts are left-padded in every turn
PROMPTS = [Prompt("1+1?", target="2"), Prompt("What is 12 + 30, please tell me?", target="42")]


def shout(x: str) -> str:
    """Says back what it got, as often as it is long.

    Args:
        x: any text.
    """
    return "got " + x * len(x)


class SometimesCalls:
    """A parser for a random model: a turn whose length is not 3 modulo 4 asks for ``shout`` of its first
    ``length % 5`` characters (so replies differ in length and rows answer at different turns)."""

    stop_text = None

    def parse(self, text):
        return [{"name": "shout", "arguments": {"x": text[:len(text) % 5]}}] if len(text) % 4 != 3 else []

    def system_prompt(self, schemas):
        return "tools: shout"


@pytest.fixture(scope="module")
def chat():
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok, turn_taking_model(tok)


def sample(tok, model, kv_cache, *, seed, parser=None, budget=120, turns=4, group_size=3):
    sampler = ToolSampler(HFSampler(model, tok, max_completion_tokens=budget, max_prompt_tokens=1024),
                          tools=[shout], parser=parser or SometimesCalls(), max_turns=turns,
                          kv_cache=kv_cache)
    return sampler.sample(PROMPTS, group_size=group_size, temperature=1.0, draws=Draws(seed=seed))


def turn_starts(env: list[bool]) -> list[int]:
    """Where each model turn starts in a rollout's env mask: 0 and each model token after an env token."""
    return [k for k, e in enumerate(env) if not e and (k == 0 or env[k - 1])]


@pytest.mark.parametrize(("seed", "budget"), [(1, 120), (2, 120), (3, 60)])
def test_keeping_the_cache_samples_the_tokens_and_log_probs_of_the_re_prefill_path(chat, seed, budget):
    tok, model = chat
    again, kept = (sample(tok, model, False, seed=seed, budget=budget),
                   sample(tok, model, True, seed=seed, budget=budget))
    turns = [e.turns for e in kept.episodes]
    assert max(turns) >= 3 and len(set(turns)) > 1  # rows ended at different turns, some after 3
    assert budget > 100 or kept.completion_mask.sum(1).max() == budget  # a row ran out of its budget
    replies = {len(m["content"]) for e in kept.episodes for m in e.messages if m["role"] == "tool"}
    assert len(replies) > 1  # the tools' replies differ in length
    assert torch.equal(again.completion_ids, kept.completion_ids)
    assert torch.equal(again.completion_mask, kept.completion_mask)
    assert torch.equal(again.env_mask, kept.env_mask)
    assert torch.equal(again.is_truncated, kept.is_truncated) and again.texts == kept.texts
    assert [e.messages for e in again.episodes] == [e.messages for e in kept.episodes]
    gap = (again.sampler_logprobs - kept.sampler_logprobs).abs().max()
    assert gap < 1e-5 and kept.sampler_logprobs[kept.loss_mask].abs().min() > 0  # fp32, every token's


def test_the_prefill_counts_are_the_prompt_and_the_environments_tokens_against_every_context(chat):
    tok, model = chat
    again, kept = sample(tok, model, False, seed=3), sample(tok, model, True, seed=3)
    prompts = kept.prompt_mask.sum(1).tolist()
    envs = [r[m].tolist() for r, m in zip(kept.env_mask, kept.completion_mask)]
    # kept: each row's prompt once, then only the environment's tokens (P + its env tokens)
    assert kept.metrics["turns/prefill_tokens"] == sum(prompts) + kept.env_mask.sum().item()
    # re-prefilled: every turn prefills the prompt and everything before the turn
    whole = sum(p + start for p, env in zip(prompts, envs) for start in turn_starts(env))
    assert again.metrics["turns/prefill_tokens"] == whole
    assert whole > 1.5 * kept.metrics["turns/prefill_tokens"]


def test_a_turn_prefills_only_what_extends_a_rows_cache_and_a_context_that_does_not_starts_afresh(chat):
    tok, model = chat
    # <bos> as the EOS: never drawn by this model (bias -30), so each turn runs its whole budget
    turns = CachedTurns(model, tok, eos_ids=[2], pad_id=0, token_draw=HFSampler(model, tok).token_draw)
    a, b = tok.encode("<user>hi<eos>\n<assistant>"), tok.encode("<user>a longer question<eos>\n<assistant>")
    args = dict(places=[0, 5], temperature=1.0, stop_texts=(), total_rows=6)
    first = turns.generate_turn([a, b], max_new_tokens=[6, 4], seed=1, **args)
    assert turns.prefilled == len(a) + len(b) and [len(t.ids) for t in first] == [6, 4]
    assert [t.ended for t in first] == ["length", "length"] and set(turns.rows) == {0, 5}
    reply = tok.encode("\n<tool>ok<eos>\n<assistant>")
    # row 0 goes on (prefills the reply only); at place 5, another context (prefilled whole)
    other = tok.encode("<user>new<eos>\n<assistant>")
    turns.generate_turn([a + list(first[0].ids) + reply, other], max_new_tokens=[3, 3], seed=2, **args)
    assert turns.prefilled == len(a) + len(b) + len(reply) + len(other)
    assert turns.rows[0].held == len(a) + 6 + len(reply) + 2  # all but its last sampled token
    assert turns.rows[0].layers[0][0].shape[2] == turns.rows[0].held  # no padding kept
    turns.generate_turn([other], max_new_tokens=[1], seed=3, places=[5], temperature=1.0, stop_texts=(),
                        total_rows=6)
    assert set(turns.rows) == {5}  # a place absent from a call finished: its cache freed
    turns.reset()
    assert turns.rows == {} and turns.prefilled == 0
    with pytest.raises(ValueError, match="must be distinct"):
        turns.generate_turn([a, a], max_new_tokens=[1, 1], seed=0, places=[1, 1], temperature=1.0,
                            stop_texts=())


def test_a_row_started_afresh_beside_a_cached_one_samples_what_each_samples_alone(chat):
    tok, model = chat
    long = tok.encode("<user>a much longer question than the other<eos>\n<assistant>")
    short = tok.encode("<user>new<eos>\n<assistant>")  # its padding queries see no key at all

    def turns():
        return CachedTurns(model, tok, eos_ids=[2], pad_id=0, token_draw=HFSampler(model, tok).token_draw)

    args = dict(temperature=1.0, seed=1, stop_texts=(), total_rows=6)
    kept = turns()
    first = kept.generate_turn([long], max_new_tokens=[3], places=[0], temperature=1.0, seed=0, stop_texts=(),
                               total_rows=6)
    going_on = long + list(first[0].ids) + [5]
    mixed = kept.generate_turn([going_on, short], max_new_tokens=[5, 5], places=[0, 5], **args)
    for got, (context, place) in zip(mixed, [(going_on, 0), (short, 5)]):
        [alone] = turns().generate_turn([context], max_new_tokens=[5], places=[place], **args)
        assert got.ids == alone.ids
        assert max(abs(x - y) for x, y in zip(got.logprobs, alone.logprobs)) < 1e-5


def test_stop_texts_end_turns_where_they_did_on_both_paths(chat):
    tok, model = chat
    often_e = turn_taking_model(tok)
    often_e.lm_head.bias.data[1] = 1.0  # longer turns
    often_e.lm_head.bias.data[tok.convert_tokens_to_ids("e")] = 2.0

    class ClosesOnE(SometimesCalls):
        stop_text = "e"  # a frequent character here: turns end right after it

    again = sample(tok, often_e, False, seed=4, parser=ClosesOnE())
    kept = sample(tok, often_e, True, seed=4, parser=ClosesOnE())
    assert torch.equal(again.completion_ids, kept.completion_ids) and again.texts == kept.texts
    said = [m["content"] for e in kept.episodes for m in e.messages if m["role"] == "assistant"]
    assert sum(text.endswith("e") for text in said) > 5 and max(e.turns for e in kept.episodes) >= 3
    for text in said:
        assert "e" not in text[:-1]  # nothing was generated after the first "e"


def _stops_by_window(tok, ids: list[int], text: str) -> int | None:
    """Yesterday's test: after each token, the turn's last len(text) + 2 tokens decoded hold ``text``."""
    for t in range(1, len(ids) + 1):
        if text in tok.decode(ids[max(0, t - len(text) - 2):t], skip_special_tokens=False):
            return t
    return None


def test_the_stop_check_stops_where_decoding_every_rows_window_did_and_decodes_fewer_rows(chat):
    tok, _ = chat
    alphabet = tok.convert_tokens_to_ids(["a", ">", "/", "b", "<eos>"])
    torch.manual_seed(0)
    streams = torch.tensor(alphabet)[torch.randint(len(alphabet), (64, 40))]
    check = StopCheck(tok, ["a/>", ""])
    decoded = []
    check.tokenizer = _Counting(tok, decoded)
    found: list[int | None] = [None] * len(streams)
    for t in range(1, streams.shape[1] + 1):
        running = [k for k in range(len(streams)) if found[k] is None]
        for k, hit in zip(running, check(streams[running, :t]).tolist()):
            found[k] = t if hit else None
    expected = [_stops_by_window(tok, row.tolist(), "a/>") for row in streams]
    assert found == expected and 10 < sum(s is not None for s in expected) < 64
    # only rows whose newest token holds ">" (">" itself, "<eos>") were decoded
    assert 0 < len(decoded) < sum(t if t else 40 for t in expected) / 2


class _Counting:
    """A tokenizer that records the rows it batch-decodes."""

    def __init__(self, tok, seen: list) -> None:
        self.tok, self.seen = tok, seen

    def decode(self, ids, **kwargs):
        return self.tok.decode(ids, **kwargs)

    def batch_decode(self, rows, **kwargs):
        self.seen += rows
        return self.tok.batch_decode(rows, **kwargs)


def test_the_cache_is_kept_only_where_the_model_allows_it(chat):
    tok, model = chat
    assert keeps_cache(model) is None and keeps_cache(torch.nn.Linear(2, 2)) == "not a transformers causal LM"
    sliding = turn_taking_model(tok)
    sliding.config.layer_types, sliding.config.sliding_window = ["sliding_attention", "full_attention"], 8
    assert "sliding_attention" in keeps_cache(sliding)
    base = HFSampler(sliding, tok, max_completion_tokens=16)
    assert not ToolSampler(base, tools=[shout], parser=SometimesCalls()).kv_cache  # re-prefilled
    with pytest.raises(ValueError, match="kv_cache=None or False"):
        ToolSampler(base, tools=[shout], parser=SometimesCalls(), kv_cache=True)
