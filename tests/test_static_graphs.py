"""The static decoder kept for a run (grpo_engine.sampling.static.StaticDecoding), on the CPU with a stand-in
capture whose graphs replay by running the step: one decoder reused across calls with other prompts, fewer
rows, shorter prompts and completions, other temperatures and a data-parallel place samples what a fresh
decoder and the dynamic loop sample; each bucket's step is captured once per run and nothing empties the
allocator's cache; bucketed attention draws the whole width's tokens; an optimizer's in-place update (of the
LoRA adapters too) is followed and a replaced weight captured again; a failed capture falls back; the
compiled step inside the graph compiles twice per run and is called directly; the sampler keeps one decoder.
What only a GPU shows (real CUDA graphs, their speed) is benchmarks/gpu/decode_check.py's."""

import functools

import pytest
import torch

from grpo_engine import LoRA, MemoryPlan
from grpo_engine.data import PlainTemplate
from grpo_engine.memory.apply import prepare_model
from grpo_engine.sampling import compiled_step, hf, static
from grpo_engine.sampling.decode import TokenDraw, decode
from grpo_engine.sampling.hf import HFSampler
from grpo_engine.sampling.static import StaticDecoding, decode_static
from grpo_engine.types import Prompt

from .tiny import ReplayByRunning, char_tokenizer, tiny_llama

EOS = [5, 9, 14]  # ids a few rows reach before their last token


def encode(tok, questions):
    return HFSampler(tiny_llama(len(tok)), tok, template=PlainTemplate("Q:{question}\nA:")).encode_prompts(
        [Prompt(q, "") for q in questions])


def calls(tok) -> list[dict]:
    """Three calls into one decoder of 6 rows x (20 + 12) slots: 3 prompts x 2 of up to 18 tokens; then
    2 x 2 of up to 8 tokens at another temperature, as rank 1 of 3; then one 1-token prompt x 3, 8 tokens."""
    ids, mask = encode(tok, ["1+1", "what is 12+30", "7"])
    short_ids, short_mask = encode(tok, ["8*9", "5"])
    return [dict(ids=ids, mask=mask, repeats=2, max_new_tokens=12, temperature=0.9),
            dict(ids=short_ids, mask=short_mask, repeats=2, max_new_tokens=12, temperature=0.7, row_offset=4,
                 total_rows=12),
            dict(ids=torch.tensor([[17]]), mask=torch.ones(1, 1, dtype=torch.bool), repeats=3,
                 max_new_tokens=8, temperature=1.1)]


def kept(model, capture, **kw) -> StaticDecoding:
    options = dict(rows=6, prompt_tokens=20, max_new_tokens=12, eos_ids=EOS, pad_id=0, draw=TokenDraw(),
                   mode="cuda_graph", bucket_tokens=4, compile_step=False, capture=capture)
    return StaticDecoding(model, **{**options, **kw})


def run(decoding, call, seed, info=None):
    """One call on ``decoding`` (a StaticDecoding, decode_static or decode), seeded."""
    call = dict(call)
    ids, mask, temperature = call.pop("ids"), call.pop("mask"), call.pop("temperature")
    torch.manual_seed(seed)
    extra = {} if info is None else dict(info=info)
    draw = TokenDraw(temperature=temperature)
    return decoding(ids, mask, eos_ids=EOS, pad_id=0, draw=draw, **call, **extra)


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-5)  # float rounding of another attended width


def lora_model(tok):
    model = prepare_model(tiny_llama(len(tok)), MemoryPlan(lora=LoRA(r=4, alpha=8)))
    with torch.no_grad():  # non-zero adapters, so the deltas matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model.eval()


def test_a_kept_decoder_samples_what_a_fresh_one_and_the_dynamic_loop_sample():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    decoding = kept(model, ReplayByRunning())
    ended = 0
    for seed, call in enumerate(calls(tok) * 2):
        out = run(decoding, call, seed)
        fresh = run(functools.partial(decode_static, model, bucket_tokens=None), call, seed)
        dynamic = run(functools.partial(decode, model), call, seed)
        assert_same(out, fresh)
        assert_same(out, dynamic)
        assert out[0].shape == (call["ids"].shape[0] * call["repeats"], call["max_new_tokens"])
        ended += int(torch.isin(out[0][:, :-1], torch.tensor(EOS)).any(1).sum())
    assert ended >= 2  # some rows ended early, so the kept buffers' done flags and padding were exercised


def test_each_bucket_is_captured_once_per_run_and_nothing_empties_the_cache(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: emptied.append("synchronize"))
    tok = char_tokenizer()
    capture = ReplayByRunning()
    decoding = kept(tiny_llama(len(tok)), capture)
    infos = [{} for _ in range(6)]
    for seed, (call, info) in enumerate(zip(calls(tok) * 2, infos)):
        run(decoding, call, seed, info)
    # a graph per bucket the first round reached (of widths 4 .. 31: 20 + 12 slots), none after it
    assert len(capture.graphs) == len(decoding.steps) == sum(info["captures"] for info in infos[:3]) > 3
    assert [info["captures"] for info in infos[3:]] == [0, 0, 0]
    assert all(info["path"] == "cuda_graph" and info["graph_step"] == "eager" for info in infos)
    assert sorted(decoding.steps) == [w for w in decoding.buckets if w in decoding.steps]
    assert all(w in decoding.buckets and w < decoding.decoder.width for w in decoding.steps)
    whole = ReplayByRunning()  # without buckets: one graph for the run
    decoding = kept(tiny_llama(len(tok)), whole, bucket_tokens=None)
    for seed, call in enumerate(calls(tok)):
        run(decoding, call, seed)
    assert len(whole.graphs) == 1 and whole.graphs[0].replays == 12 + 12 + 8  # every step of the 3 calls
    assert emptied == []


def test_bucketed_attention_draws_the_whole_widths_tokens(monkeypatch):
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    widths = []
    grouped = static.grouped_attention
    monkeypatch.setattr(static, "grouped_attention",
                        lambda module, q, k, v, mask, **kw: widths.append(mask.shape[-1]) or grouped(
                            module, q, k, v, mask, **kw))
    for seed, call in enumerate(calls(tok)):
        whole = run(functools.partial(decode_static, model, bucket_tokens=None), call, seed)
        widths.clear()
        bucketed = run(functools.partial(decode_static, model, bucket_tokens=4), call, seed)
        assert_same(bucketed, whole)
        width = call["ids"].shape[1] + call["max_new_tokens"]
        steps = [w for i, w in enumerate(widths) if i % 2 == 0]  # two layers per step
        assert steps == sorted(steps) and steps[0] < width - 4  # early tokens read fewer slots


def test_the_kept_decoder_follows_in_place_updates_and_captures_again_when_a_weight_moves():
    """An optimizer step writes the weights and the LoRA adapters in place: the next call samples from the
    new policy (the concatenated A copy refreshed) without capturing again. A weight replaced by a new tensor
    would leave a graph reading freed memory: the call notices and captures again, with a warning."""
    tok = char_tokenizer()
    model = lora_model(tok)
    capture = ReplayByRunning()
    decoding = kept(model, capture, concat_lora=True)
    assert len(decoding.lora.groups) == 4  # q/k/v and gate/up of 2 layers
    call = calls(tok)[0]
    run(decoding, call, 0)
    first = len(capture.graphs)
    with torch.no_grad():  # an optimizer step: every trainable tensor written in place
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    info = {}
    out = run(decoding, call, 1, info)
    assert_same(out, run(functools.partial(decode, model), call, 1))
    assert info["captures"] == 0 and len(capture.graphs) == first
    weight = model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight
    weight.data = weight.data * 1.5  # a new tensor, as merge_lora's temporary copies are
    info = {}
    with pytest.warns(UserWarning, match="weight tensors moved"):
        out = run(decoding, call, 2, info)
    assert_same(out, run(functools.partial(decode, model), call, 2))
    assert info["captures"] == first


def test_the_cache_takes_the_dtypes_autocast_gives_and_a_call_without_autocast_needs_another_decoder():
    """The trainer samples under its autocast (float32 weights, bfloat16 compute): the values come out in
    bfloat16 and the keys, rotated with float32 cos / sin, in float32. The kept cache takes each layer's
    dtypes from the first call's prefill (a one-token prompt: from one probing token), and the autocast
    state is part of what a call must match."""
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    call, one_token = calls(tok)[0], calls(tok)[2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoding, probed = kept(model, ReplayByRunning()), kept(model, ReplayByRunning())
        run(probed, one_token, 0)
        for seed in range(2):
            out = run(decoding, call, seed)
            fresh = run(functools.partial(decode_static, model, bucket_tokens=4), call, seed)
            assert torch.equal(out[0], fresh[0]) and torch.equal(out[1], fresh[1])
    for cache in (decoding.decoder.cache, probed.decoder.cache):
        assert {k.dtype for k in cache.keys} == {torch.float32}
        assert {v.dtype for v in cache.values} == {torch.bfloat16}
    settings = dict(rows=6, prompt_tokens=18, max_new_tokens=12, eos_ids=EOS, pad_id=0, draw=TokenDraw())
    assert not decoding.fits(**settings)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert decoding.fits(**settings)
    with pytest.raises(ValueError, match="does not fit this static decoder"):
        run(decoding, call, 0)


def test_a_failed_capture_falls_back_to_eager_steps_once_for_the_run():
    tok = char_tokenizer()
    model = tiny_llama(len(tok))

    class Fails(ReplayByRunning):
        def capture(self, run):
            self.tries = getattr(self, "tries", 0) + 1
            raise RuntimeError("simulated capture failure")

    capture = Fails()
    decoding = kept(model, capture)
    for seed, call in enumerate(calls(tok)):
        info = {}
        if seed == 0:
            with pytest.warns(UserWarning, match="could not capture the decoding step"):
                out = run(decoding, call, seed, info)
        else:
            out = run(decoding, call, seed, info)
        assert_same(out, run(functools.partial(decode, model), call, seed))
        assert info["path"] == "static" and info["capture_error"] == "RuntimeError: simulated capture failure"
    assert capture.tries == 1


def test_a_step_that_cannot_compile_is_captured_eager(monkeypatch):
    tok = char_tokenizer()
    model = tiny_llama(len(tok))

    def cannot(*args, **kwargs):
        raise RuntimeError("simulated inductor failure")

    monkeypatch.setattr(static, "compiled", cannot)
    capture = ReplayByRunning()
    decoding = kept(model, capture, compile_step=True)
    call, info = calls(tok)[0], {}
    with pytest.warns(UserWarning, match="compiled decoding step"):
        out = run(decoding, call, 0, info)
    assert_same(out, run(functools.partial(decode, model), call, 0))
    assert info["path"] == "cuda_graph" and info["graph_step"] == "eager" and info["captures"] > 1
    assert info["compile_error"] == "RuntimeError: simulated inductor failure"
    assert info["capture_error"] is None


def test_the_compiled_step_in_the_graph_compiles_twice_per_run_and_follows_in_place_updates(monkeypatch):
    """torch.compile of the step (about a minute on 2 cores), with LoRA's concatenated A products: the first
    bucket compiles with its width, the second once more with the width symbolic, and every later bucket
    reuses that graph. Each capture holds the compiled graph called directly, bound to the decoder's and the
    model's tensors: an in-place update of the weights and adapters between calls is read by the next."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_step, "_COMPILED", {})
    compiles = []
    recording = compiled_step.recording_backend

    def counting(options):
        backend = recording(options)
        return lambda graph, inputs: compiles.append(1) or backend(graph, inputs)

    monkeypatch.setattr(compiled_step, "recording_backend", counting)
    tok = char_tokenizer()
    model = lora_model(tok)
    capture = ReplayByRunning()
    decoding = kept(model, capture, compile_step=True, concat_lora=True)
    for seed, call in enumerate(calls(tok)[:2]):
        info = {}
        assert_same(run(decoding, call, seed, info), run(functools.partial(decode, model), call, seed))
        assert info["graph_step"] == "compiled" and info["compile_error"] is None
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name or "up_proj.base_layer" in name:
                    p.add_(torch.randn_like(p) * 0.3)
    assert len(compiles) == 2 and len(capture.graphs) > 3
    wrapper = static.compiled(static._bucket_step, "cpu", dynamic=None)
    assert all(isinstance(g.run, functools.partial) and g.run.func is not wrapper for g in capture.graphs)


def test_the_sampler_keeps_one_decoder_for_the_run(monkeypatch):
    monkeypatch.setattr(hf, "resolve_decoding", lambda decoding, model, device: decoding)
    monkeypatch.setattr(static, "CudaGraphCapture", ReplayByRunning)
    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    template = PlainTemplate("Q:{question}\nA:")
    graphs = HFSampler(model, tok, template=template, max_prompt_tokens=24, max_completion_tokens=10,
                       temperature=0.8, decoding="cuda_graph", compile_step=False)
    static_path = HFSampler(model, tok, template=template, max_completion_tokens=10, temperature=0.8,
                            decoding="static")
    batches = [([Prompt("12+30", "42"), Prompt("7*8", "56")], 4), ([Prompt("9", "9")], 3),
               ([Prompt("what is 1+1", "2"), Prompt("3", "3")], 4)]
    decoders = []
    for seed, (prompts, group) in enumerate(batches):
        torch.manual_seed(seed)
        ours = graphs.sample(prompts, group_size=group)
        torch.manual_seed(seed)
        expected = static_path.sample(prompts, group_size=group)
        assert torch.equal(ours.completion_ids, expected.completion_ids) and ours.texts == expected.texts
        torch.testing.assert_close(ours.sampler_logprobs, expected.sampler_logprobs, rtol=0, atol=1e-5)
        decoders.append(graphs.decoding_kept)
        assert graphs.last_decoding["path"] == "cuda_graph" and graphs.last_decoding["graph_step"] == "eager"
    assert decoders[0] is decoders[1] is decoders[2]
    assert decoders[0].decoder.rows == 8 and decoders[0].decoder.width == 24 + 10
    graphs.sample([Prompt("1", "1")] * 3, group_size=4)  # more rows than any call before: a larger decoder
    assert graphs.decoding_kept is not decoders[0] and graphs.decoding_kept.decoder.rows == 12
    graphs.release_decoder()  # frees the KV cache and graphs between calls; the next call builds anew
    assert graphs.decoding_kept is None
    graphs.sample([Prompt("1", "1")], group_size=2)
    assert graphs.decoding_kept is not None and graphs.last_decoding["captures"] > 0
    # merge_lora's merged weights are new tensors at every call: no decoder kept
    assert not HFSampler(lora_model(tok), tok, decoding="cuda_graph", merge_lora=True).keep_decoder


@pytest.mark.parametrize("compile_decoding", [True, False])
def test_the_plan_says_which_step_the_trainers_graphs_replay(tmp_path, compile_decoding):
    """``MemoryPlan(compile_decoding=...)`` reaches the trainer's sampler: the compiled step (the default) or
    the eager one in its CUDA graphs."""
    from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan

    def zero(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    tok = char_tokenizer()
    trainer = GRPOTrainer(tiny_llama(len(tok)), [zero],
                          [Prompt("1+1", "2")] * 4, tokenizer=tok, template=PlainTemplate("{question}"),
                          config=GRPOConfig(prompts_per_step=2, group_size=2, output_dir=str(tmp_path),
                                            progress_bar=False),
                          memory=MemoryPlan(compile_decoding=compile_decoding))
    assert trainer.sampler.compile_step is compile_decoding
