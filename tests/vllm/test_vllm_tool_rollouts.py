"""Tool rollouts on vLLM (vllm-cpu, SmolLM2-135M-Instruct in float32), colocated and through the session's
server: each turn continues a row from its exact token ids; the log-probs vLLM returns for the model's
tokens equal the training pass's over the whole row (the environment's tokens in between, masked) within
1e-4 across turn boundaries; a stop text ends a turn at the token that completed it, the ids being those
sampled; a row's draws are its own (its place's, whatever rows run beside it) and repeat with the seed;
the colocated engine serves a later turn's context from its prefix cache. Runs in the vLLM venv
(``make test-vllm``)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU

from grpo_engine.logprobs import completion_logprobs  # noqa: E402
from grpo_engine.models import load_model  # noqa: E402
from grpo_engine.sampling.vllm import VLLMSampler  # noqa: E402
from grpo_engine.sampling.vllm_server import VLLMServerSampler  # noqa: E402
from grpo_engine.tools.rollout import ToolSampler  # noqa: E402
from grpo_engine.types import Draws, Prompt  # noqa: E402

TOLERANCE = 1e-4  # float32: vLLM's kernels against transformers'
QUESTIONS = ["Write one sentence about the sea.", "Name three colours and say why you like them."]
# a long system message: contexts longer than the CPU backend's 128-token cache blocks (the prefix cache
# holds whole blocks)
SYSTEM = "You are a helpful assistant. You write short, clear sentences about what you are asked. " * 10
REPLY = "<|im_end|>\n<|im_start|>user\nThe tool says: 42. Go on.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["colocated", "server"])
def policy(request, folder):
    """The untrained policy and a vLLM sampler of it (the server's: its first sync reloads every weight,
    so the server holds the folder's weights whatever ran on it before)."""
    model, tokenizer = load_model(str(folder))
    settings = dict(max_prompt_tokens=256, max_completion_tokens=64)
    if request.param == "colocated":
        sampler = VLLMSampler(model, tokenizer, engine_model=folder, engine_kwargs={"enforce_eager": True},
                              **settings)
    else:
        sampler = VLLMServerSampler(model, tokenizer, base_url=request.getfixturevalue("server"), **settings)
    yield model, tokenizer, sampler
    sampler.close()


def prompt_ids(sampler, tokenizer, question):
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return sampler.encode_text(text)


def training_logprobs(model, prompts, completions, pad_id):
    """The training pass's log-probs of each row's completion (prompts left-padded, completions
    right-padded), at temperature 1: a list of per-token lists."""
    p_width, c_width = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), p_width), pad_id)
    mask = torch.zeros((len(prompts), p_width), dtype=torch.bool)
    out = torch.full((len(prompts), c_width), pad_id)
    keep = torch.zeros((len(prompts), c_width), dtype=torch.bool)
    for k, (p, c) in enumerate(zip(prompts, completions)):
        ids[k, p_width - len(p):], mask[k, p_width - len(p):] = torch.tensor(p), True
        out[k, :len(c)], keep[k, :len(c)] = torch.tensor(c), True
    with torch.no_grad():
        logprobs = completion_logprobs(model, ids, mask, out, keep)
    return [row[:len(c)].tolist() for row, c in zip(logprobs, completions)]


def two_turns(sampler, tokenizer, seed):
    """Two turns of four rows (two per question) by hand: the first ends at a full stop (a "call"), the
    environment's reply follows as token ids, then a second turn from the whole context."""
    prompts = [prompt_ids(sampler, tokenizer, q) for q in QUESTIONS for _ in range(2)]
    places = [0, 1, 2, 3]
    first = sampler.generate_turn(prompts, max_new_tokens=[24] * 4, places=places, temperature=1.0, seed=seed,
                                  stop_texts=["."])
    reply = sampler.encode_text(REPLY)
    contexts = [p + list(t.ids) + reply for p, t in zip(prompts, first)]
    second = sampler.generate_turn(contexts, max_new_tokens=[16] * 4, places=places, temperature=1.0,
                                   seed=seed + 1_000_003, stop_texts=[])
    return prompts, first, reply, second


def test_a_two_turn_rollout_has_the_training_passs_logprobs_across_the_turn(policy):
    model, tokenizer, sampler = policy
    spied = []
    if isinstance(sampler, VLLMSampler):  # the engine's own answers, for their prefix-cache counts
        sampler._ready()  # the engine started
        generate = sampler.engine.generate

        def spy(*args, **kwargs):
            outputs = generate(*args, **kwargs)
            spied.append([out.num_cached_tokens for out in outputs])
            return outputs

        sampler.engine.generate = spy
    prompts, first, reply, second = two_turns(sampler, tokenizer, seed=11)
    assert {t.ended for t in first} <= {"stop", "eos", "length"} and "stop" in {t.ended for t in first}
    rows = [list(a.ids) + reply + list(b.ids) for a, b in zip(first, second)]
    ours = training_logprobs(model, prompts, rows, sampler.pad_id)
    gaps = []
    for a, b, trained in zip(first, second, ours):
        gaps += [abs(x - y) for x, y in zip(a.logprobs, trained[:len(a.ids)])]
        gaps += [abs(x - y) for x, y in zip(b.logprobs, trained[len(a.ids) + len(reply):])]
        assert len(trained) == len(a.ids) + len(reply) + len(b.ids)
    assert sum(len(b.ids) for b in second) > 16 and max(gaps) < TOLERANCE, max(gaps)
    # seeded: the same turns again, each row's draws its own (row 3 alone, at its place, draws the same)
    _, first_again, _, second_again = two_turns(sampler, tokenizer, seed=11)
    assert [t.ids for t in first_again + second_again] == [t.ids for t in first + second]
    alone = sampler.generate_turn([prompts[3]], max_new_tokens=[24], places=[3], temperature=1.0, seed=11,
                                  stop_texts=["."])
    assert alone[0].ids == first[3].ids
    if spied:  # the second turn's contexts start with whole 128-token blocks the first turn computed
        assert len(prompts[0]) > 128 and all(cached >= 128 for cached in spied[1]), spied


def test_a_stop_text_ends_the_turn_at_the_token_that_completed_it(policy):
    _, tokenizer, sampler = policy
    context = prompt_ids(sampler, tokenizer, QUESTIONS[1])
    free, stopped = (sampler.generate_turn([context] * 3, max_new_tokens=[24] * 3, places=[0, 1, 2],
                                           temperature=1.0, seed=5, stop_texts=stop) for stop in ([], ["e"]))
    for whole, turn in zip(free, stopped):
        # the ids are those sampled (the same draws as without the stop text), through the first token
        # whose text completes "e", which vLLM keeps whole even where the stop text ends inside it
        assert turn.ended == "stop" and turn.ids == whole.ids[:len(turn.ids)]
        assert "e" in tokenizer.decode(turn.ids) and "e" not in tokenizer.decode(turn.ids[:-1])
        assert max(abs(x - y) for x, y in zip(turn.logprobs, whole.logprobs)) < TOLERANCE
    assert any(not tokenizer.decode(t.ids).endswith("e") for t in stopped)  # one ended inside a token


def note(text: str) -> str:
    """Notes a sentence.

    Args:
        text: the sentence.
    """
    return f"Noted ({len(text)} characters). Write another sentence."


class EverySentenceCalls:
    """A parser for a model never shown a tool: a turn that writes a full stop calls ``note``, so rows go
    on for several turns."""

    stop_text = "."

    def parse(self, text):
        return [{"name": "note", "arguments": {"text": text}}] if "." in text else []

    def system_prompt(self, schemas):
        return "You write one sentence at a time."


def test_a_tool_rollout_generates_every_turn_on_vllm_with_the_training_passs_logprobs(policy):
    model, _, sampler = policy
    tools = ToolSampler(sampler, tools=[note], parser=EverySentenceCalls(), max_turns=3)
    calls = []
    generate_turn = sampler.generate_turn

    def counted(contexts, **kwargs):
        calls.append(len(contexts))
        return generate_turn(contexts, **kwargs)

    sampler.generate_turn = counted
    try:
        prompts = [Prompt(q, "") for q in QUESTIONS]
        batch = tools.sample(prompts, group_size=2, temperature=1.0, draws=Draws(seed=3))
        again = tools.sample(prompts, group_size=2, temperature=1.0, draws=Draws(seed=3))
    finally:
        del sampler.generate_turn
    assert len(calls) >= 4 and calls[0] == 4  # every turn of both calls went to vLLM
    assert torch.equal(batch.completion_ids, again.completion_ids)
    env, keep = batch.env_mask, batch.completion_mask
    # a row with a model turn after the tool's reply: the turn boundary is crossed
    later = keep & ~env & (env.cumsum(dim=1) > 0)
    assert later.sum() > 5
    with torch.no_grad():
        ours = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, keep)
    model_tokens = keep & ~env
    assert (ours[model_tokens] - batch.sampler_logprobs[model_tokens]).abs().max() < TOLERANCE


def test_a_trainer_trains_on_tool_rollouts_generated_on_vllm(folder, tmp_path):
    """GRPOTrainer with a ToolSampler over the colocated engine, LoRA synced as an adapter: every turn of
    both steps is generated on vLLM (each step's rollouts call the tool), the second step samples with
    the adapter the first trained, and the trainer's log-probs of the model's tokens equal the engine's
    (mean gap under 1e-4; the environment's tokens are not trained on, so not compared)."""
    from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan

    model, tokenizer = load_model(str(folder))
    engine = VLLMSampler(model, tokenizer, engine_model=folder, max_prompt_tokens=256,
                         max_completion_tokens=48, engine_kwargs={"enforce_eager": True})
    turns = []
    generate_turn = engine.generate_turn

    def counted(contexts, **kwargs):
        turns.append(len(contexts))
        return generate_turn(contexts, **kwargs)

    engine.generate_turn = counted
    sampler = ToolSampler(engine, tools=[note], parser=EverySentenceCalls(), max_turns=2)

    def short(completions, **columns):  # varies within a group: every step trains
        return [1.0 / (1 + len(c)) for c in completions]

    prompts = [Prompt(q) for q in QUESTIONS * 4]
    config = GRPOConfig(prompts_per_step=2, group_size=2, max_completion_tokens=48, max_prompt_tokens=256,
                        max_steps=2, learning_rate=1e-3, output_dir=str(tmp_path), progress_bar=False,
                        max_turns=2)
    trainer = GRPOTrainer(model, [short], prompts, config, MemoryPlan(lora=LoRA(r=4)), tokenizer=tokenizer,
                          sampler=sampler)
    try:
        history = trainer.train()
    finally:
        engine.close()
    assert len(history) == 2 and len(turns) >= 3  # a second turn in some step: every turn on the engine
    assert all(h["tools/calls"] > 0 for h in history)
    assert engine.lora and all(h["mismatch/logprob_abs"] < TOLERANCE for h in history)
