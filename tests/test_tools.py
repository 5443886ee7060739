"""Multi-turn rollouts with tools: the parser, the tool calls' limits, exact tokens (the environment's are
the chat template's ids, never trained on; the sampler's log-probs equal the training pass's across turns),
ranks, rewards that read the conversation and the environment, the trainer, and resume."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from grpo_engine import GRPOConfig, GRPOTrainer
from grpo_engine.distributed import DataParallel
from grpo_engine.gradients import PolicyGradient
from grpo_engine.logprobs import completion_logprobs
from grpo_engine.losses import ClippedSurrogate
from grpo_engine.memory.plan import MemoryPlan
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.sandbox import sandbox_available
from grpo_engine.tools import CodeBlockParser, HermesParser, ToolSampler, as_tool, call_tools, python_tool
from grpo_engine.types import Draws, MicroBatch, Prompt
from grpo_engine.world import World
from tests.tiny import char_tokenizer, tiny_llama

# a ChatML-like template: each turn ends with the EOS token, as Qwen's and SmolLM2's do
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def echo(x: str) -> str:
    """Says back what it got.

    Args:
        x: any text.
    """
    return "got " + x


class EveryTurnCalls:
    """A parser for a random model: every turn asks for ``echo`` of its first characters."""

    stop_text = None

    def parse(self, text):
        return [{"name": "echo", "arguments": {"x": text[:3]}}]

    def system_prompt(self, schemas):
        return "tools: " + ", ".join(s["function"]["name"] for s in schemas)


def turn_taking_model(tok):
    """The tiny model with a head that ends turns soon (EOS +4) and never writes another special token."""
    model = tiny_llama(len(tok))
    head = torch.nn.Linear(model.lm_head.in_features, len(tok), bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()
    head.bias.data[[0, 2, 3]] = -30.0  # <pad>, <bos>, <unk>
    head.bias.data[1] = 4.0  # <eos>
    model.lm_head = head
    return model


@pytest.fixture
def chat():
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok, turn_taking_model(tok)


def tool_sampler(tok, model, budget=96, **kwargs):
    kwargs.setdefault("parser", EveryTurnCalls())
    return ToolSampler(HFSampler(model, tok, max_completion_tokens=budget), tools=[echo], max_turns=3,
                       **kwargs)


PROMPTS = [Prompt("1+1?", target="2"), Prompt("2+3?", target="5")]


def test_hermes_parser_reads_calls_in_order_and_says_why_one_cannot_be_read():
    text = ('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
            '<tool_call>{"name": "neg", "arguments": "{\\"a\\": 3}"}</tool_call> '
            '<tool_call>add(1, 2)</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>')
    calls = HermesParser().parse(text)
    assert calls[:2] == [{"name": "add", "arguments": {"a": 1, "b": 2}},
                         {"name": "neg", "arguments": {"a": 3}}]
    assert calls[2]["name"] is None and "not valid JSON" in calls[2]["error"]
    assert calls[3]["name"] is None and '"name"' in calls[3]["error"]
    assert HermesParser().parse("The answer is 3.") == []
    # an unclosed call at the end of a cut turn is still read
    cut = HermesParser().parse('<tool_call>{"name": "add", "arguments": {}}')
    assert cut == [{"name": "add", "arguments": {}}]


def test_the_code_block_parser_reads_fenced_python_as_calls_to_the_python_tool():
    parser = CodeBlockParser()
    text = "First:\n```python\nprint(1)\n```\nthen ```py\nx = 2\nprint(x)\n``` and ```\nnot python\n```"
    assert parser.parse(text) == [{"name": "python", "arguments": {"code": "print(1)\n"}},
                                  {"name": "python", "arguments": {"code": "x = 2\nprint(x)\n"}}]
    assert not parser.call_closed("```python\nprint(1)\n") and parser.call_closed("```python\nprint(1)\n```")
    assert parser.parse("no code here") == []


def test_a_parser_without_stop_text_ends_the_turn_when_it_says_a_call_closed(chat):
    tok, model = chat

    class ClosedAtB(EveryTurnCalls):
        def call_closed(self, text):
            return "b" in text

    base = HFSampler(model, tok, max_completion_tokens=64, max_prompt_tokens=1024)
    batch = ToolSampler(base, tools=[echo], parser=ClosedAtB(), max_turns=1).sample(
        PROMPTS, group_size=4, temperature=1.0, draws=Draws(seed=4))
    assert any("b" in text for text in batch.texts)
    for text in batch.texts:
        assert "b" not in text[:-1]  # nothing was generated after the first "b"


def test_a_tools_schema_comes_from_its_hints_and_docstring_and_a_bare_function_is_refused():
    schema = as_tool(echo).schema["function"]
    assert schema["name"] == "echo" and schema["parameters"]["properties"]["x"]["type"] == "string"

    def bare(x):
        return x

    with pytest.raises(ValueError, match="type hint"):
        as_tool(bare)


def test_a_tool_that_raises_hangs_or_floods_is_reported_and_bounded():
    def boom(x: int) -> int:
        """Fails.

        Args:
            x: ignored.
        """
        raise ZeroDivisionError("no")

    def hang(x: int) -> int:
        """Hangs.

        Args:
            x: ignored.
        """
        time.sleep(3)
        return x

    def flood(x: int) -> str:
        """Floods.

        Args:
            x: ignored.
        """
        return "a" * 1_000_000

    tools = {t.name: t for t in map(as_tool, (boom, hang, flood, echo))}
    start = time.perf_counter()
    [results] = call_tools([(tools, [{"name": n, "arguments": {"x": 1}} for n in ("boom", "hang", "flood")]
                            + [{"name": "missing", "arguments": {}}, {"name": None, "error": "bad JSON"},
                               {"name": "echo", "arguments": {"y": 1}}])], timeout_s=0.3, max_chars=100)
    assert time.perf_counter() - start < 2.0  # the hanging call did not hold the turn
    assert [r.status for r in results] == ["error", "timeout", "ok", "error", "error", "error"]
    assert results[0].content == "Error: ZeroDivisionError: no"
    assert "did not return within 0.3 s" in results[1].content
    assert results[2].cut and len(results[2].content) < 200 and "1000000 characters" in results[2].content
    assert "no tool named 'missing'" in results[3].content and "bad JSON" in results[4].content
    assert "TypeError" in results[5].content  # bad arguments: the model reads the error


def test_environment_tokens_are_the_chat_templates_ids_and_the_model_tokens_are_as_sampled(chat):
    tok, model = chat
    sampler = tool_sampler(tok, model)
    batch = sampler.sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=3))
    assert batch.env_mask.any() and batch.metrics["tools/calls"] > 0
    for i in range(batch.num_completions):
        rollout = torch.cat([batch.prompt_ids[i][batch.prompt_mask[i]],
                             batch.completion_ids[i][batch.completion_mask[i]]])
        # the whole conversation, rendered and tokenised as one text by the chat template
        messages = sampler.messages(batch.row_prompts[i]) + list(batch.episodes[i].messages)
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        whole = tok(text, add_special_tokens=False)["input_ids"]
        assert whole[:len(rollout)] == rollout.tolist()
        env = batch.env_mask[i][batch.completion_mask[i]]
        ids = batch.completion_ids[i][batch.completion_mask[i]]
        spans = [tok.decode(ids[start:end]) for start, end in _runs(env)]
        replies = [m["content"] for m in batch.episodes[i].messages if m["role"] == "tool"]
        assert spans == [f"\n<tool>{r}<eos>\n<assistant>" for r in replies]  # every reply, cut or whole
        said = batch.episodes[i].messages
        assert batch.episodes[i].turns == len([m for m in said if m["role"] == "assistant"])


def _runs(mask):
    """(start, end) of each run of True in a 1-d bool tensor."""
    runs, start = [], None
    for k, flag in enumerate(mask.tolist() + [False]):
        if flag and start is None:
            start = k
        elif not flag and start is not None:
            runs.append((start, k))
            start = None
    return runs


def test_the_samplers_logprobs_equal_the_training_pass_across_turn_boundaries(chat):
    tok, model = chat
    batch = tool_sampler(tok, model).sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=5))
    assert (batch.episodes[0].turns > 1 or batch.episodes[1].turns > 1) and batch.env_mask.any()
    with torch.no_grad():
        trained = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                      batch.completion_mask, score_mask=batch.loss_mask)
    keep = batch.loss_mask
    assert (trained[keep] - batch.sampler_logprobs[keep]).abs().max() < 1e-5  # ratio 1 on every sampled token
    assert (trained[batch.env_mask] == 0).all() and (batch.sampler_logprobs[batch.env_mask] == 0).all()


def test_no_gradient_reaches_an_environment_token(chat):
    tok, model = chat
    batch = tool_sampler(tok, model).sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=5))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    # every token scored, with gradient; the loss's mask is the batch's loss mask
    logprobs = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask)
    logprobs.retain_grad()
    loss = ClippedSurrogate()
    tokens, rows = loss.counts(batch.loss_mask, batch.is_truncated)
    out = loss(logprobs, MicroBatch(completion_mask=batch.loss_mask, advantages=advantages),
               num_valid_tokens=tokens, num_sequences=rows)
    out.loss.backward()
    assert (logprobs.grad[batch.env_mask] == 0).all()
    assert (logprobs.grad[batch.loss_mask] != 0).any()
    # the trainer's gradient pass trains on the same tokens: its parameter gradient equals this one
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    gradients = PolicyGradient(model, loss, MemoryPlan(micro_batch_size=2), DataParallel(World()),
                               log_entropy=False)
    found = gradients(batch, advantages, temperature=1.0)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the sampler's log-probs against the trainer's, over the trained tokens: 0 here, 0.5 when shifted
    assert found.metrics["mismatch/logprob_abs"] < 1e-6
    shifted = dataclasses.replace(batch, sampler_logprobs=batch.sampler_logprobs + 0.5 * batch.loss_mask)
    model.zero_grad(set_to_none=True)
    found = gradients(shifted, advantages, temperature=1.0)
    assert found.metrics["mismatch/logprob_abs"] == pytest.approx(0.5, abs=1e-5)


def test_two_ranks_sample_what_one_process_samples(chat):
    tok, model = chat
    sampler = tool_sampler(tok, model)
    whole = sampler.sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=11))
    shares = [sampler.sample(PROMPTS[r:r + 1], group_size=2, temperature=1.0,
                             draws=Draws(seed=11, first_prompt=r, total_prompts=2)) for r in range(2)]
    for r, share in enumerate(shares):
        rows = slice(2 * r, 2 * r + 2)
        width = share.completion_ids.shape[1]
        assert torch.equal(share.completion_ids, whole.completion_ids[rows, :width])
        assert torch.equal(share.env_mask, whole.env_mask[rows, :width])
        assert not whole.completion_mask[rows, width:].any()
        assert share.texts == whole.texts[rows]


class Counter:
    """A stateful environment: reset with the prompt's target; its method is the tool."""

    def reset(self, target: str) -> str:
        self.target, self.total = target, 0
        return f" (reach {target})"

    def add(self, n: int) -> int:
        """Adds n to the running total and returns it.

        Args:
            n: how much to add.
        """
        self.total += n
        return self.total


class AddsOne:
    stop_text = None

    def parse(self, text):
        return [{"name": "add", "arguments": {"n": 1}}]

    def system_prompt(self, schemas):
        return "tools: add"


def test_an_environment_per_rollout_whose_state_the_rewards_read(chat):
    tok, model = chat
    sampler = ToolSampler(HFSampler(model, tok, max_completion_tokens=96), environment_factory=Counter,
                          parser=AddsOne(), max_turns=3)
    assert [s["function"]["name"] for s in sampler.schemas] == ["add"]
    batch = sampler.sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=1))
    envs = [e.environment for e in batch.episodes]
    assert len({id(e) for e in envs}) == 4  # one per rollout
    assert [e.target for e in envs] == ["2", "2", "5", "5"]
    for episode in batch.episodes:  # each call added 1 to that rollout's own total
        replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert replies == [str(k) for k in range(1, len(replies) + 1)]
        assert episode.environment.total == len(replies)
    assert "(reach 2)" in tok.decode(batch.prompt_ids[0][batch.prompt_mask[0]])

    seen = {}

    def reached(prompts, completions, conversations, environments, target, **columns):
        seen["conversations"] = conversations
        return [float(str(env.total) == t) for env, t in zip(environments, target)]

    from grpo_engine.rewards import WeightedSum

    out = WeightedSum([reached])(batch)
    assert out.breakdown["reached"].flatten().tolist() == [float(str(e.total) == t) for e, t in
                                                           zip(envs, ["2", "2", "5", "5"])]
    assert seen["conversations"][0] == list(batch.episodes[0].messages)


def test_a_rollout_ends_at_its_turn_limit_and_its_token_budget(chat):
    tok, model = chat
    batch = tool_sampler(tok, model, budget=400).sample(PROMPTS, group_size=2, temperature=1.0,
                                                        draws=Draws(seed=2))
    # EveryTurnCalls asks in every turn: a rollout not cut by its budget stops at max_turns=3, truncated
    ends = [e.end for e in batch.episodes]
    assert "turn_limit" in ends and set(ends) <= {"turn_limit", "token_limit", "reply_too_long"}
    assert all(e.turns == 3 for e in batch.episodes if e.end == "turn_limit")
    assert batch.metrics["turns/limit_reached"] == ends.count("turn_limit") == batch.metrics[
        "ends/turn_limit"]
    assert batch.is_truncated.all()  # no rollout answered
    short = tool_sampler(tok, model, budget=12).sample(PROMPTS, group_size=2, temperature=1.0,
                                                      draws=Draws(seed=2))
    assert short.completion_mask.sum(1).max() <= 12
    assert short.is_truncated.all()  # no room left for an answer after the tools' messages


def test_a_prompt_over_the_limit_loses_its_middle_and_is_counted(chat):
    tok, model = chat
    sampler = ToolSampler(HFSampler(model, tok, max_completion_tokens=16, max_prompt_tokens=40), tools=[echo],
                          parser=EveryTurnCalls(), max_turns=1)
    whole = len(sampler.prompt_tokens(PROMPTS[0]))
    assert whole > 40
    with pytest.warns(UserWarning, match=f"a prompt of {whole} tokens"):
        batch = sampler.sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=1))
    assert batch.prompt_mask.sum(1).tolist() == [40] * 4 and batch.metrics["prompts/truncated"] == 2.0
    ids = batch.prompt_ids[0][batch.prompt_mask[0]].tolist()
    assert ids[-20:] == sampler.prompt_tokens(PROMPTS[0])[-20:]  # the question's end, the generation prompt


def test_stop_at_call_ends_the_turn_at_the_closing_text(chat):
    tok, model = chat

    class ClosesOnA(HermesParser):
        stop_text = "a"  # a frequent character: turns end right after it

    base = HFSampler(model, tok, max_completion_tokens=64, max_prompt_tokens=1024)  # Hermes' tool prompt
    batch = ToolSampler(base, tools=[echo], parser=ClosesOnA(),
                        max_turns=1).sample(PROMPTS, group_size=2, temperature=1.0, draws=Draws(seed=4))
    for text in batch.texts:
        assert "a" not in text[:-1]  # nothing was generated after the first "a"
        assert text.endswith("a") or "a" not in text


def test_the_trainer_runs_with_tools_logs_them_and_resumes_bit_for_bit(chat, tmp_path):
    tok, _ = chat
    prompts = [Prompt(f"{a}+{b}?", target=str(a + b)) for a in range(3) for b in range(3)]

    def short(prompts, completions, **columns):
        return [1.0 / (1 + len(c)) for c in completions]

    def run(out, steps, resume=None):
        torch.manual_seed(0)
        model = turn_taking_model(tok)
        cfg = GRPOConfig(prompts_per_step=2, group_size=2, max_steps=steps, max_completion_tokens=48,
                         learning_rate=1e-2, max_turns=2, output_dir=str(out), save_every_steps=1,
                         progress_bar=False)
        trainer = GRPOTrainer(model, [short], prompts, cfg, tokenizer=tok, tools=[echo], resume_from=resume)
        trainer.sampler.parser = EveryTurnCalls()
        return trainer, trainer.train()

    trainer, history = run(tmp_path / "a", 3)
    assert isinstance(trainer.sampler, ToolSampler)
    assert history[0]["tools/calls"] > 0 and 1 <= history[0]["turns/mean"] <= 2
    _, resumed = run(tmp_path / "a", 3, resume=str(tmp_path / "a" / "checkpoint-1"))
    assert [h["loss"] for h in resumed] == [h["loss"] for h in history[1:]]
    assert [h["tools/calls"] for h in resumed] == [h["tools/calls"] for h in history[1:]]


needs_sandbox = pytest.mark.skipif(sandbox_available() is not None,
                                   reason=f"no sandbox: {sandbox_available()}")


@needs_sandbox
def test_the_python_tool_runs_the_models_program_in_the_sandbox(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret")
    python = python_tool(timeout_s=3, max_chars=200).fn
    assert python(code="print(123 * 456)") == "56088"
    assert python(code="import os\nprint(os.environ.get('WANDB_API_KEY'), os.getcwd())") == "None /scratch"
    assert python(code="1 / 0").endswith("ZeroDivisionError: division by zero")
    assert python(code="while True: pass").endswith("[stopped: timeout]")
    assert python(code="print('x' * 10000)").endswith("[cut]")
