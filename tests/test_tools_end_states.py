"""One truth per episode: every way a multi-turn rollout ends (``Episode.end``), built deterministically, with
the conversation, the tokens (and their environment mask), the environment and ``is_truncated`` agreeing,
and the end state what a reward function reads (``episode_ends``).

The model is scripted by its head: one that always samples EOS first (a turn is the one token ``<eos>``,
its text empty) or one that never does (every turn runs to the budget). The parser decides the calls. With
the character tokenizer every character is one token and the template is ``<role>content<eos>\\n``, so a
turn's token counts are written out by hand below.
"""

from __future__ import annotations

import pickle
import time

import pytest
import torch

from grpo_engine.rewards import WeightedSum
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.tools import ToolSampler
from grpo_engine.types import EPISODE_ENDS, Draws, Episode, Prompt
from tests.test_tools import TEMPLATE
from tests.tiny import char_tokenizer, tiny_llama

EOS = 1


class Notebook:
    """An environment that counts the calls that ran; call k answers ten copies of the digit k."""

    def reset(self) -> None:
        self.calls = 0

    def read(self, pause: float) -> str:
        """Reads the next page.

        Args:
            pause: seconds to wait after counting the call.
        """
        self.calls += 1
        time.sleep(pause)
        return str(self.calls) * 10


class Calls:
    """A parser that reads ``k`` calls of ``read`` in every turn, whatever the model wrote."""

    stop_text = None

    def __init__(self, k: int, pause: float = 0.0) -> None:
        self.k, self.pause = k, pause

    def parse(self, text):
        return [{"name": "read", "arguments": {"pause": self.pause}}] * self.k

    def system_prompt(self, schemas):
        return "tools: read"


def scripted_model(tok, eos_bias: float):
    """The tiny model whose head always (+30) or never (-30) samples EOS, and never another special."""
    model = tiny_llama(len(tok))
    head = torch.nn.Linear(model.lm_head.in_features, len(tok), bias=True)
    head.weight.data.zero_()
    head.bias.data.zero_()
    head.bias.data[[0, 2, 3]] = -30.0  # <pad>, <bos>, <unk>
    head.bias.data[EOS] = eos_bias
    model.lm_head = head
    return model


@pytest.fixture(scope="module")
def tok():
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def sample(tok, *, eos_bias=30.0, budget=200, calls=1, max_turns=3, pause=0.0, timeout=5.0):
    sampler = ToolSampler(HFSampler(scripted_model(tok, eos_bias), tok, max_completion_tokens=budget,
                                    max_prompt_tokens=1024, return_logprobs=True),
                          environment_factory=Notebook, parser=Calls(calls, pause), max_turns=max_turns,
                          tool_timeout_s=timeout)
    return sampler, sampler.sample([Prompt("1+1?")], group_size=2, temperature=1.0, draws=Draws(seed=0))


def check_one_truth(tok, sampler, batch):
    """What every end state keeps: the tokens are the chat template's rendering of the prompt and the
    episode's messages (through the next generation prompt when they end with the tools' replies; the
    model's last turn without the end marker it did not sample), the environment's tokens are exactly the
    tools' messages, the environment ran exactly the answered calls, and ``is_truncated`` is
    ``end != 'answered'``.
    """
    assert batch.is_truncated.tolist() == [e.end != "answered" for e in batch.episodes]
    assert batch.metrics[f"ends/{batch.episodes[0].end}"] == batch.num_completions
    for i, episode in enumerate(batch.episodes):
        assert episode.end in EPISODE_ENDS
        rollout = torch.cat([batch.prompt_ids[i][batch.prompt_mask[i]],
                             batch.completion_ids[i][batch.completion_mask[i]]]).tolist()
        messages = sampler.messages(batch.row_prompts[i]) + list(episode.messages)
        on_tool = messages[-1]["role"] == "tool"
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=on_tool)
        whole = tok(text, add_special_tokens=False)["input_ids"]
        if on_tool:
            assert whole == rollout
        else:  # the template closes the last assistant turn: "<eos>\n", or "\n" after a sampled <eos>
            assert whole[:len(rollout)] == rollout
            closing = tok.decode(whole[len(rollout):])
            assert closing == ("\n" if rollout[-1] == EOS else "<eos>\n")
        ids = batch.completion_ids[i][batch.completion_mask[i]]
        env = batch.env_mask[i][batch.completion_mask[i]]
        replies = [m for m in episode.messages if m["role"] == "tool"]
        assert tok.decode(ids[env]) == "".join(  # after each sampled <eos>: the tools' frames, nothing else
            "".join(f"\n<tool>{r['content']}<eos>" for r in block) + "\n<assistant>"
            for block in _blocks(episode.messages))
        assert episode.environment.calls == len(replies)  # every call that ran has its reply, no other
        assert episode.turns == sum(m["role"] == "assistant" for m in episode.messages)
        assert int(batch.completion_lengths[i]) == int((~env).sum())  # the model's tokens only


def _blocks(messages):
    """The runs of tool messages, in order."""
    blocks, run = [], []
    for m in list(messages) + [{"role": "assistant"}]:
        if m["role"] == "tool":
            run.append(m)
        elif run:
            blocks.append(run)
            run = []
    return blocks


def test_answered_a_turn_without_a_call_ends_the_rollout_untruncated(tok):
    sampler, batch = sample(tok, calls=0)
    check_one_truth(tok, sampler, batch)
    assert [e.end for e in batch.episodes] == ["answered"] * 2 and not batch.is_truncated.any()
    assert batch.completion_mask.sum(1).tolist() == [1, 1]  # the turn: <eos>
    assert [e.environment.calls for e in batch.episodes] == [0, 0] and not batch.env_mask.any()


def test_turn_limit_the_last_turns_call_is_read_not_run_and_the_row_is_truncated(tok):
    sampler, batch = sample(tok, max_turns=2)
    check_one_truth(tok, sampler, batch)
    for episode in batch.episodes:
        assert episode.end == "turn_limit" and episode.turns == 2
        assert len(episode.tool_calls) == 2  # both calls were read ...
        assert episode.environment.calls == 1  # ... the last turn's never ran
        assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]
        assert episode.messages[1]["content"] == "1" * 10
    # <eos>, then "\n<tool>" 7 + 10 digits + "<eos>" 1 + "\n<assistant>" 12 = 30 environment tokens,
    # then <eos>
    assert batch.completion_mask.sum(1).tolist() == [32, 32] and batch.env_mask.sum(1).tolist() == [30, 30]
    assert batch.completion_lengths.tolist() == [2, 2] and batch.is_truncated.all()
    assert batch.metrics["turns/limit_reached"] == 2


def test_token_limit_mid_turn_the_call_is_not_read_and_the_environment_untouched(tok):
    sampler, batch = sample(tok, eos_bias=-30.0, budget=9)
    check_one_truth(tok, sampler, batch)
    for episode in batch.episodes:
        assert episode.end == "token_limit" and episode.tool_calls == () and episode.environment.calls == 0
        assert [m["role"] for m in episode.messages] == ["assistant"]
    assert batch.completion_lengths.tolist() == [9, 9] and batch.is_truncated.all()
    assert (batch.completion_ids[batch.completion_mask] != EOS).all()


def test_token_limit_when_even_an_empty_reply_leaves_no_room_the_call_does_not_run(tok):
    # <eos> 1 + an empty reply's 7 + 0 + 1 + 12 = 21 tokens: a budget of 21 leaves no token for a next turn
    sampler, batch = sample(tok, budget=21)
    check_one_truth(tok, sampler, batch)
    for episode in batch.episodes:
        assert episode.end == "token_limit" and episode.environment.calls == 0
        assert len(episode.tool_calls) == 1 and [m["role"] for m in episode.messages] == ["assistant"]
    assert batch.completion_mask.sum(1).tolist() == [1, 1] and batch.is_truncated.all()


@pytest.mark.parametrize("budget, kept", [(22, "1"), (26, "11111"), (31, "1" * 10)])
def test_reply_too_long_the_call_ran_and_its_reply_is_cut_alike_in_messages_and_tokens(tok, budget, kept):
    # room after <eos>: budget - 1; the reply takes 20 tokens + its characters, so budget - 21 of them fit;
    # the whole reply (budget 31) that leaves no token for a next turn ends here too
    sampler, batch = sample(tok, budget=budget)
    check_one_truth(tok, sampler, batch)
    for episode in batch.episodes:
        assert episode.end == "reply_too_long" and episode.environment.calls == 1 and episode.turns == 1
        assert [m["content"] for m in episode.messages if m["role"] == "tool"] == [kept]
    assert batch.completion_mask.sum(1).tolist() == [budget] * 2  # the budget, filled
    assert batch.completion_lengths.tolist() == [1, 1] and batch.is_truncated.all()


def test_reply_too_long_with_two_replies_keeps_the_first_whole_and_cuts_the_second(tok):
    # room 41 after <eos>: two empty replies take 7 + 1 + 7 + 1 + 12 = 28, so 13 characters fit: 10 + 3
    sampler, batch = sample(tok, budget=42, calls=2)
    check_one_truth(tok, sampler, batch)
    for episode in batch.episodes:
        assert episode.end == "reply_too_long" and episode.environment.calls == 2
        assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["1" * 10, "222"]
    assert batch.completion_mask.sum(1).tolist() == [42, 42]


def test_a_reply_that_leaves_one_token_lets_the_model_take_its_next_turn(tok):
    sampler, batch = sample(tok, budget=32, max_turns=2)  # 31 tokens, then room for one: the next <eos>
    check_one_truth(tok, sampler, batch)
    assert [e.end for e in batch.episodes] == ["turn_limit"] * 2  # its second turn called again
    assert batch.completion_mask.sum(1).tolist() == [32, 32]


def test_tool_timeout_the_reply_stands_in_messages_and_tokens_and_the_row_is_truncated(tok):
    sampler, batch = sample(tok, pause=0.3, timeout=0.05)
    check_one_truth(tok, sampler, batch)
    for episode in batch.episodes:
        assert episode.end == "tool_timeout" and episode.turns == 1
        assert "did not return within 0.05 s" in episode.messages[1]["content"]
    assert batch.metrics["turns/ended_by_timeout"] == 2 and batch.is_truncated.all()
    time.sleep(0.35)  # the late calls finish in the background


def test_the_reward_reads_the_end_state_and_an_episode_keeps_it_through_pickling(tok):
    ends, seen = {}, {}

    def finished(prompts, completions, episode_ends, conversations, **columns):
        seen["ends"] = episode_ends
        return [float(end == "answered") for end in episode_ends]

    for name, kwargs in {"answered": {"calls": 0}, "turn_limit": {"max_turns": 1},
                         "token_limit": {"budget": 21}, "reply_too_long": {"budget": 26}}.items():
        _, batch = sample(tok, **kwargs)
        out = WeightedSum([finished])(batch)
        ends[name] = seen["ends"]
        assert out.total.flatten().tolist() == [float(name == "answered")] * 2
        episode = pickle.loads(pickle.dumps(batch.episodes[0]))
        assert episode.end == name and episode.environment is None
    assert ends == {name: [name] * 2 for name in ends}
    with pytest.raises(ValueError, match="end='done' is not an end state"):
        Episode((), end="done")
