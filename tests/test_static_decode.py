"""The static decoding path (grpo_engine.sampling.static) against the dynamic loop: the same tokens and
log-probs for greedy and seeded draws, ragged prompts, an EOS in the middle, one-token prompts, top-k /
top-p; grouped attention against a float64 reference; the cache size against the memory estimator;
the CUDA-graph warm-up leaving no trace; the path chosen per device."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_engine import LoRA, MemoryPlan
from grpo_engine.data import PlainTemplate
from grpo_engine.memory.estimate import Workload, estimate_memory
from grpo_engine.sampling import compiled_step, static
from grpo_engine.sampling.decode import TokenDraw, decode
from grpo_engine.sampling.hf import HFSampler, resolve_decoding
from grpo_engine.sampling.static import StaticDecoder, decode_static, grouped_attention, load, supports_static
from grpo_engine.types import Prompt

from .tiny import ReplayByRunning, char_tokenizer, tiny_llama


def tiny_qwen2(vocab_size: int) -> Qwen2ForCausalLM:
    """Qwen2-shaped (q/k/v biases, 6 query heads over 2 KV heads), random init."""
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
                         initializer_range=0.2)
    return Qwen2ForCausalLM(config).eval()


def ragged_prompts(model, tok):
    """Left-padded prompts of three lengths (4, 16 and 3 tokens) and an EOS id that the first greedy
    row reaches at its third token, so rows end at different steps."""
    sampler = HFSampler(model, tok, template=PlainTemplate("Q:{question}\nA:"))
    ids, mask = sampler.encode_prompts([Prompt("1+1", ""), Prompt("what is 12+30", ""), Prompt("7", "")])
    free = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=10,
                          eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
    return ids, mask, int(free[0, 2])


def both_paths(model, ids, mask, draw, **kw):
    torch.manual_seed(0)
    dynamic = decode(model, ids, mask, draw=draw, pad_id=0, **kw)
    torch.manual_seed(0)
    fixed = decode_static(model, ids, mask, draw=draw, pad_id=0, **kw)
    return dynamic, fixed


DRAWS = {
    "greedy": TokenDraw(greedy=True, logprobs=True),
    "sampled": TokenDraw(temperature=0.9),
    "top_k": TokenDraw(temperature=0.9, top_k=5),
    "top_p": TokenDraw(temperature=0.9, top_p=0.7),
}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(DRAWS))
def test_static_path_draws_the_dynamic_loops_tokens(family, name):
    tok = char_tokenizer()
    model = tiny_llama(len(tok)) if family == "llama" else tiny_qwen2(len(tok))
    ids, mask, eos = ragged_prompts(model, tok)
    (ids_d, lp_d), (ids_s, lp_s) = both_paths(model, ids, mask, DRAWS[name], repeats=3, max_new_tokens=20,
                                              eos_ids=[eos])
    assert torch.equal(ids_d, ids_s)
    torch.testing.assert_close(lp_s, lp_d, rtol=0, atol=1e-5)  # float rounding of other kernels
    ends = [row.index(eos) if eos in row else None for row in ids_d.tolist()]
    # rows end mid-way, at other steps
    assert any(e is not None and e < 19 for e in ends) and len(set(ends)) > 1
    if name != "greedy":
        assert len({tuple(r) for r in ids_d.tolist()}) > 3  # the draws differ between rows of a group


def test_rows_after_their_eos_hold_padding_and_zero_logprobs():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask, eos = ragged_prompts(model, tok)
    out, logprobs = decode_static(model, ids, mask, repeats=1, max_new_tokens=10, eos_ids=[eos], pad_id=0,
                                  draw=DRAWS["greedy"], check_every=16)  # rows run on past their EOS
    assert out[0, 2] == eos and (out[0, 3:] == 0).all() and (logprobs[0, 3:] == 0).all()
    assert (logprobs[0, :3] < 0).all()


def test_one_token_prompts_and_an_eos_set():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask = torch.tensor([[7], [12]]), torch.ones(2, 1, dtype=torch.bool)
    (ids_d, lp_d), (ids_s, lp_s) = both_paths(model, ids, mask, DRAWS["sampled"], repeats=4,
                                              max_new_tokens=12, eos_ids=[5, 9, 14])
    assert torch.equal(ids_d, ids_s)
    torch.testing.assert_close(lp_s, lp_d, rtol=0, atol=1e-5)


def test_the_sampler_gives_one_rollout_batch_on_either_path():
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok))
    prompts = [Prompt("12+30", "42"), Prompt("7*8", "56")]
    batches = []
    for path in ("dynamic", "static"):
        sampler = HFSampler(model, tok, template=PlainTemplate("Q:{question}\nA:"), max_completion_tokens=10,
                            temperature=0.8, decoding=path)
        torch.manual_seed(3)
        batches.append(sampler.sample(prompts, group_size=4))
    dynamic, fixed = batches
    assert torch.equal(dynamic.completion_ids, fixed.completion_ids)
    assert torch.equal(dynamic.completion_mask, fixed.completion_mask) and dynamic.texts == fixed.texts
    torch.testing.assert_close(fixed.sampler_logprobs, dynamic.sampler_logprobs, rtol=0, atol=1e-5)


def test_a_distribution_with_nan_is_refused():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    with torch.no_grad():
        model.lm_head.weight[3] = float("nan")
    ids, mask = torch.tensor([[7, 8]]), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="sums to zero or holds NaN"):
        decode_static(model, ids, mask, repeats=2, max_new_tokens=4, eos_ids=[1], pad_id=0,
                      draw=DRAWS["sampled"], check_every=16)


def test_grouped_attention_equals_attention_over_repeated_heads_in_float64():
    torch.manual_seed(0)
    n, heads, kv, q, width, d = 3, 6, 2, 2, 7, 8
    query, key, value = (torch.randn(n, heads, q, d), torch.randn(n, kv, width, d),
                         torch.randn(n, kv, width, d))
    allowed = torch.rand(n, 1, q, width) > 0.4
    allowed[..., 0] = True  # every query sees at least one key
    out, _ = grouped_attention(None, query, key, value, allowed, scaling=0.3)
    k64 = key.double().repeat_interleave(heads // kv, 1)  # query head i reads KV head i // 3
    v64 = value.double().repeat_interleave(heads // kv, 1)
    scores = (query.double() @ k64.transpose(-1, -2)) * 0.3
    reference = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v64  # [n, h, q, d]
    torch.testing.assert_close(out.double(), reference.transpose(1, 2), rtol=0, atol=1e-6)
    assert out.shape == (n, q, heads, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_is_the_size_the_memory_estimator_predicts(dtype):
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok)).to(dtype)
    ids, mask, _ = ragged_prompts(model.float(), tok)
    model = model.to(dtype)
    prompts, group, completion = ids.shape[0], 4, 24
    decoder = StaticDecoder(model, rows=prompts * group, prompt_tokens=ids.shape[1],
                            max_new_tokens=completion, eos_ids=[1], pad_id=0, draw=DRAWS["greedy"])
    assert decoder.cache.nbytes == 0  # allocated by the first call, in the dtypes the model writes
    load(decoder, ids, mask, repeats=group, temperature=1.0)
    plan = MemoryPlan(dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    predicted = estimate_memory(model.config, plan, Workload(prompts_per_step=prompts, group_size=group,
                                                             prompt_tokens=ids.shape[1],
                                                             completion_tokens=completion)).parts["kv_cache"]
    # 12 rows x (P + 24) slots x 2 layers x (keys + values) x 2 KV heads x 8 dims
    assert decoder.cache.nbytes == predicted == 12 * (ids.shape[1] + 24) * 2 * 2 * 2 * 8 * dtype.itemsize
    assert decoder.cache.nbytes == static.static_cache_bytes(model.config, 12, ids.shape[1] + 24, dtype)


def test_the_graph_warm_up_leaves_no_trace():
    """Before capturing a bucket's step the runner runs it twice for real and puts back what it changed;
    the replays must then draw what eager steps draw. On the CPU a stand-in capture replays by running the
    step, so the warm-up runs for real, which is what this checks (at every bucket: 4 slots each)."""
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask, eos = ragged_prompts(model, tok)
    kw = dict(repeats=2, max_new_tokens=10, eos_ids=[eos], pad_id=0, draw=DRAWS["sampled"])
    torch.manual_seed(5)
    eager = decode_static(model, ids, mask, bucket_tokens=4, **kw)
    capture = ReplayByRunning()
    decoding = static.StaticDecoding(model, rows=6, prompt_tokens=ids.shape[1], max_new_tokens=10,
                                     eos_ids=[eos], pad_id=0, draw=DRAWS["sampled"], mode="cuda_graph",
                                     bucket_tokens=4, compile_step=False, capture=capture)
    torch.manual_seed(5)
    info = {}
    graphs = decoding(ids, mask, info=info, **kw)
    assert torch.equal(eager[0], graphs[0]) and torch.equal(eager[1], graphs[1])
    assert info["path"] == "cuda_graph"
    assert info["captures"] == len(decoding.steps) == len(capture.graphs) >= 2
    assert sum(g.replays for g in capture.graphs) == 10  # every step a replay (rows run on to the 10th token)


def test_the_compiled_step_draws_the_eager_tokens(monkeypatch):
    """torch.compile of the step (about 30 s on 2 cores): the uniforms are drawn outside it, so the
    random stream and the tokens are the eager path's. Only the first step goes through torch.compile;
    every later one calls its compiled graph directly."""
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids, mask, eos = ragged_prompts(model, tok)
    kw = dict(repeats=3, max_new_tokens=12, eos_ids=[eos], pad_id=0, draw=DRAWS["sampled"])
    torch.manual_seed(0)
    eager = decode_static(model, ids, mask, **kw)
    steps, fill = [], StaticDecoder.fill_uniforms
    monkeypatch.setattr(StaticDecoder, "fill_uniforms", lambda self, u: steps.append(1) or fill(self, u))
    for _ in range(2):  # the second call reuses the first call's graph
        torch.manual_seed(0)
        steps.clear()
        info = {}
        compiled = decode_static(model, ids, mask, mode="compiled", info=info, **kw)
        assert torch.equal(eager[0], compiled[0])
        torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-5)
        assert len(steps) > 1 and info["direct_steps"] == len(steps) - 1


# -- which path runs ----------------------------------------------------------------------------


def test_auto_takes_the_dynamic_loop_on_the_cpu_and_explicit_paths_are_checked():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    cpu = torch.device("cpu")
    assert resolve_decoding("auto", model, cpu) == "dynamic"
    assert resolve_decoding("auto", model, torch.device("cuda")) == "cuda_graph"
    assert resolve_decoding("static", model, cpu) == "static"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_decoding("cuda_graph", model, cpu)
    with pytest.raises(ValueError, match="is not one of auto, dynamic, static, compiled, cuda_graph"):
        HFSampler(model, tok, decoding="graph")


def test_models_the_static_path_cannot_run_fall_back_or_are_refused():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    model.config._attn_implementation = "flex_attention"
    assert "needs 'sdpa' or 'eager'" in supports_static(model)
    assert resolve_decoding("auto", model, torch.device("cuda")) == "dynamic"
    with pytest.raises(ValueError, match="cannot run this model"):
        resolve_decoding("static", model, torch.device("cpu"))
    model.config._attn_implementation = "sdpa"
    model.config.model_type = "gemma2"
    assert "model type 'gemma2'" in supports_static(model)


def test_a_lora_model_samples_the_same_on_both_paths():
    from grpo_engine.memory.apply import prepare_model

    tok = char_tokenizer()
    model = prepare_model(tiny_llama(len(tok)), MemoryPlan(lora=LoRA(r=4, alpha=8)))
    with torch.no_grad():  # a non-zero adapter, so the delta matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    ids, mask, eos = ragged_prompts(model, tok)
    (ids_d, lp_d), (ids_s, lp_s) = both_paths(model, ids, mask, DRAWS["sampled"], repeats=2,
                                              max_new_tokens=10, eos_ids=[eos])
    assert torch.equal(ids_d, ids_s)
    torch.testing.assert_close(lp_s, lp_d, rtol=0, atol=1e-5)


def test_logprobs_match_a_full_forward():
    """The static path's log-probs are the temperature-scaled log-softmax of a plain forward over
    prompt + completion (no cache at all)."""
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok))
    ids, mask = torch.tensor([[0, 0, 9, 10, 11], [12, 13, 14, 15, 16]]), torch.tensor([[0, 0, 1, 1, 1]] * 1
                                                                                        + [[1] * 5]).bool()
    torch.manual_seed(0)
    out, logprobs = decode_static(model, ids, mask, repeats=1, max_new_tokens=6, eos_ids=[999], pad_id=0,
                                  draw=TokenDraw(temperature=0.7))
    full_ids = torch.cat([ids, out], 1)
    full_mask = torch.cat([mask, torch.ones_like(out, dtype=torch.bool)], 1).long()
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=full_mask,
                       position_ids=(full_mask.cumsum(1) - 1).clamp(min=0)).logits
    expected = F.log_softmax(logits[:, 4:-1].double() / 0.7, -1).gather(-1, out[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=1e-5)


def test_only_a_step_that_writes_tensors_in_place_is_called_directly():
    """first_compiled_call hands back the graph for direct calls only when the step ran as one graph that
    returned nothing (every write in place); a step that rebinds an attribute makes dynamo return the new
    tensor to store, so its later steps keep going through torch.compile. Nothing is recorded afterwards."""

    class InPlace:
        def __init__(self):
            self.x = torch.zeros(3)

        def step(self):
            self.x.add_(1)

    class Rebinds(InPlace):
        def step(self):
            self.x = self.x + 1

    for kind, direct_expected in ((InPlace, True), (Rebinds, False)):
        step = torch.compile(kind.step, dynamic=False, backend=compiled_step.recording_backend(None))
        state = kind()
        direct = compiled_step.first_compiled_call(step, state)
        assert (direct is not None) is direct_expected
        assert compiled_step._GRAPH_RUNS[0] is None
        for _ in range(2):
            direct() if direct is not None else step(state)
        assert torch.equal(state.x, torch.full((3,), 3.0))
