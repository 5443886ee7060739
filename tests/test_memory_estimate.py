"""The memory estimator against exact counts on tiny models: parameters, adapters, 4-bit weights,
optimizer state, KV cache and the activations saved for backward (measured with saved-tensor hooks)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpo_engine.logprobs import completion_logprobs
from grpo_engine.memory import LoRA, MemoryPlan, build_optimizer, prepare_model
from grpo_engine.memory.apply import trainable_parameters
from grpo_engine.memory.budget import auto_plan, plan_for_budget
from grpo_engine.memory.estimate import (
    GIB,
    KNOWN_SHAPES,
    ModelShape,
    Workload,
    estimate_memory,
    logprob_granularity,
)

LLAMA = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
QWEN = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def build(config):
    torch.manual_seed(0)
    return (Qwen2ForCausalLM if isinstance(config, Qwen2Config) else LlamaForCausalLM)(config)


@pytest.mark.parametrize("config", [LLAMA, QWEN], ids=["llama-untied", "qwen2-tied-bias"])
def test_parameter_and_adapter_counts_are_exact(config):
    model = build(config)
    shape = ModelShape.from_config(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    for lora in (LoRA(r=4), LoRA(r=8, target_modules=["q_proj", "v_proj"])):
        policy = prepare_model(build(config), MemoryPlan(lora=lora))
        assert shape.lora_params(lora) == sum(p.numel() for p in trainable_parameters(policy))


def test_known_shapes_match_their_published_sizes():
    assert round(KNOWN_SHAPES["qwen2.5-0.5b"].num_params / 1e6) == 494  # "0.49B" on the model card
    assert round(KNOWN_SHAPES["qwen2.5-1.5b"].num_params / 1e8) == 15  # 1.54B
    assert round(KNOWN_SHAPES["qwen2.5-7b"].num_params / 1e8) == 76  # 7.61B
    assert round(KNOWN_SHAPES["smollm2-135m"].num_params / 1e6) == 135


def test_four_bit_weights_match_the_packed_model():
    pytest.importorskip("bitsandbytes")
    plan = MemoryPlan(lora=LoRA(r=4), quantization="nf4")
    model = prepare_model(build(LLAMA), plan).get_base_model()
    actual = 0
    for p in model.parameters():
        actual += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        if state is not None:  # absmax (uint8 under double quantisation) and its own scales
            actual += state.absmax.numel() * state.absmax.element_size()
            actual += state.state2.absmax.numel() * state.state2.absmax.element_size()
    lora = ModelShape.from_config(LLAMA).lora_params(plan.lora) * 4
    predicted = estimate_memory(LLAMA, plan, Workload()).parts["weights"] + lora
    assert predicted == pytest.approx(actual, rel=0.02)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_optimizer_state_matches_the_states_after_a_step(optimizer):
    if optimizer == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    plan = MemoryPlan(optimizer=optimizer)  # full fine-tuning: matrices large enough for 8-bit states
    model = prepare_model(build(QWEN), plan)
    opt = build_optimizer(model, plan, learning_rate=1e-3)
    model(torch.randint(0, 300, (2, 5))).logits.sum().backward()
    opt.step()
    actual = sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
                 if torch.is_tensor(t) and t.numel() > 1)
    predicted = estimate_memory(QWEN, plan, Workload()).parts["optimizer_state"]
    assert predicted == pytest.approx(actual, rel=0.08)  # 8-bit: + block scales; tensors < 4096 stay fp32


def test_kv_cache_matches_the_cache_of_a_forward():
    workload = Workload(prompts_per_step=2, group_size=3, prompt_tokens=7, completion_tokens=5)
    model = build(LLAMA).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 300, (workload.rows, 12)), use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    actual = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert estimate_memory(LLAMA, MemoryPlan(), workload).parts["kv_cache"] == actual


def test_a_vllm_sampler_adds_nothing_to_the_trainers_sampling_phase():
    """With sampler="vllm" the engine's own share holds its KV cache: the trainer holds only what is
    resident while sampling, and the training and optimizer phases lose only what our CUDA-graph decoder
    keeps for the run on a GPU (its KV cache and step buffers)."""
    plan = MemoryPlan(lora=LoRA(r=8))
    workload = Workload(prompts_per_step=4, group_size=8, prompt_tokens=64, completion_tokens=2048)
    ours, engine = (estimate_memory(LLAMA, plan, workload, sampler=s) for s in ("ours", "vllm"))
    resident = sum(ours.parts[k] for k in ("weights", "adapters", "optimizer_state", "reference_copy"))
    assert ours.phases["sampling"] > resident + ours.parts["kv_cache"] > resident
    assert engine.phases["sampling"] == resident and engine.parts["kv_cache"] == 0
    kept = ours.parts["kept_decoder"]
    assert kept == ours.parts["kv_cache"] + ours.parts["sampling_logits"] > 0
    assert engine.parts["kept_decoder"] == 0
    assert engine.phases["training"] == ours.phases["training"] - kept
    assert engine.phases["optimizer"] == ours.phases["optimizer"] - kept
    with pytest.raises(ValueError, match="sampler='sglang'.*'ours'.*'vllm'"):
        estimate_memory(LLAMA, plan, workload, sampler="sglang")


def test_the_cuda_graph_decoder_is_counted_in_every_phase_on_a_gpu_only():
    """A GPU's CUDA-graph decoding keeps its KV cache for the run; the CPU's dynamic loop and a plan that
    decodes without graphs free it after sampling."""
    workload = Workload(prompts_per_step=4, group_size=8, prompt_tokens=64, completion_tokens=512)
    gpu = estimate_memory(LLAMA, MemoryPlan(), workload)
    cpu = estimate_memory(LLAMA, MemoryPlan(), workload, device="cpu")
    static = estimate_memory(LLAMA, MemoryPlan(decoding="static"), workload)
    assert cpu.parts["kept_decoder"] == static.parts["kept_decoder"] == 0 < gpu.parts["kept_decoder"]
    for phase in ("training", "optimizer"):
        assert gpu.phases[phase] - static.phases[phase] == pytest.approx(gpu.parts["kept_decoder"])
    assert gpu.phases["optimizer"] - cpu.phases["optimizer"] == pytest.approx(gpu.parts["kept_decoder"])


def saved_activation_bytes(model, workload: Workload, plan: MemoryPlan) -> int:
    """Bytes of the tensors autograd saves in one micro-batch's forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    m, G = plan.micro_batch_size, workload.group_size
    pid = torch.randint(3, 300, (m // G, workload.prompt_tokens), generator=g).repeat_interleave(G, 0)
    cid = torch.randint(3, 300, (m, workload.completion_tokens), generator=g)
    model.train()
    chunk, tile = logprob_granularity(model.config.vocab_size, plan, cid.numel(), device="cpu")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logprobs(model, pid, torch.ones_like(pid, dtype=torch.bool), cid,
                            torch.ones_like(cid, dtype=torch.bool), share_prompt=plan.share_prompt,
                            chunk_size=chunk, vocab_tile=tile)
    return sum(seen.values())


@pytest.mark.parametrize("config", [LLAMA, QWEN], ids=["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["lora", "lora+checkpointing", "full", "lora, no prompt sharing"])
def test_saved_activations_within_15_percent(config, dtype, kind):
    """Shapes other than the seven the coefficients were fitted on."""
    workload = Workload(prompts_per_step=2, group_size=4, prompt_tokens=24, completion_tokens=40)
    plan = MemoryPlan(lora=None if kind == "full" else LoRA(r=8),
                      gradient_checkpointing="checkpointing" in kind,
                      share_prompt="no prompt sharing" not in kind, micro_batch_size=8, dtype=dtype)
    model = prepare_model(build(config), plan)
    actual = saved_activation_bytes(model, workload, plan)
    predicted = estimate_memory(config, plan, workload).parts["activations"]
    assert predicted == pytest.approx(actual, rel=0.15), (predicted, actual)


@pytest.mark.parametrize("config", [LLAMA, QWEN], ids=["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_mixed_precision_activations_and_weight_copies_within_15_percent(config, kind):
    """float32 weights under bfloat16 autocast: the saved activations plus autocast's bf16 copies of
    the matmul weights (saved for backward too), against what autograd saves."""
    workload = Workload(prompts_per_step=2, group_size=4, prompt_tokens=24, completion_tokens=40)
    plan = MemoryPlan(lora=LoRA(r=8) if kind == "lora" else None, micro_batch_size=8,
                      compute_dtype="bfloat16")
    model = prepare_model(build(config), plan)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        actual = saved_activation_bytes(model, workload, plan)
    parts = estimate_memory(config, plan, workload).parts
    assert parts["autocast_weights"] == (ModelShape.from_config(config).linear_params
                                         + 300 * config.hidden_size) * 2
    assert parts["activations"] + parts["autocast_weights"] == pytest.approx(actual, rel=0.15)
    fp32 = estimate_memory(config, MemoryPlan(lora=plan.lora, micro_batch_size=8), workload)
    assert fp32.parts["autocast_weights"] == 0 and fp32.parts["weights"] == parts["weights"]


def test_offloaded_activations_leave_the_device():
    workload = Workload()
    on = estimate_memory("qwen2.5-1.5b", MemoryPlan(lora=LoRA(), offload_activations=True), workload)
    off = estimate_memory("qwen2.5-1.5b", MemoryPlan(lora=LoRA()), workload)
    assert on.parts["activations"] == 0 < off.parts["activations"]
    assert on.peak_bytes < off.peak_bytes


def test_plan_for_budget_picks_the_fastest_plan_that_fits_with_its_margin():
    workload = Workload(prompts_per_step=4, group_size=8, prompt_tokens=256, completion_tokens=1024)
    previous = None
    for budget in (80, 24, 12, 8):  # tighter budgets may only cost more time
        choice = plan_for_budget("qwen2.5-1.5b", workload, budget)
        assert choice.estimate.peak_gib * 1.15 <= budget
        assert choice.estimate.peak_bytes == estimate_memory("qwen2.5-1.5b", choice.plan, workload).peak_bytes
        if previous is not None:
            assert choice.slowdown >= previous
        previous = choice.slowdown
        assert all(peak * 1.15 > budget for _, peak in choice.rejected)  # every faster plan was too big
    assert plan_for_budget("qwen2.5-1.5b", workload, 80).plan.gradient_checkpointing is False
    seven = plan_for_budget("qwen2.5-7b", workload, 12)
    assert seven.plan.quantization == "nf4" and "fits 12 GiB" in seven.reason


def test_plan_for_budget_says_when_nothing_fits():
    with pytest.raises(ValueError, match=r"no plan fits 1 GiB .* smallest predicted peak is \d+\.\d\d GiB"):
        plan_for_budget("qwen2.5-7b", Workload(), 1)
    with pytest.raises(ValueError, match="budget_gib=0 must be > 0"):
        plan_for_budget("qwen2.5-7b", Workload(), 0)


def test_shape_from_a_folder_and_bad_names(tmp_path):
    QWEN.save_pretrained(tmp_path)
    assert ModelShape.from_config(tmp_path) == ModelShape.from_config(QWEN)
    with pytest.raises(ValueError, match="no model config at"):
        ModelShape.from_config(str(tmp_path / "missing"))
    assert GIB == 2**30


def test_auto_plan_takes_a_config_as_the_workload_and_returns_the_budget_choice(capsys):
    from grpo_engine.config import GRPOConfig

    config = GRPOConfig(prompts_per_step=4, group_size=8, max_prompt_tokens=256, max_completion_tokens=1024)
    plan = auto_plan("qwen2.5-7b", config, 12)
    assert plan == plan_for_budget("qwen2.5-7b", Workload.from_config(config), 12).plan
    assert plan.quantization == "nf4" and "[auto_plan] " in capsys.readouterr().out


def test_the_log_prob_pass_is_small_on_a_cpu_and_as_few_passes_as_fit_on_a_gpu():
    """CPU: 256 tokens x 32,768 entries, as before. GPU: one chunk and one tile where the logits fit (12
    bytes a logit); else the chunk halves first (whole-vocabulary tiles), then the tile; a plan's own
    numbers win."""
    plan, vocab, tokens = MemoryPlan(), 151_936, 16 * 512
    assert logprob_granularity(vocab, plan, tokens, device="cpu") == (256, 32768)
    assert logprob_granularity(vocab, plan, tokens, device="cuda") == (tokens, vocab)
    one_pass = tokens * vocab * 12
    assert logprob_granularity(vocab, plan, tokens, device="cuda", logits_bytes=one_pass) == (tokens, vocab)
    assert logprob_granularity(vocab, plan, tokens, device="cuda", logits_bytes=one_pass - 1) == (4096, vocab)
    # 1,000 tokens in 256 x V: chunks halve to 500 (not below 256), then tiles halve: 2 x 2 passes
    fits = 256 * vocab * 12
    assert logprob_granularity(vocab, plan, 1000, device="cuda", logits_bytes=fits) == (500, 75_968)
    small = 256 * 18_992 * 12  # 256 tokens x 1/8 of the vocabulary
    assert logprob_granularity(vocab, plan, tokens, device="cuda", logits_bytes=small) == (256, 18_992)
    assert logprob_granularity(vocab, plan, tokens, device="cuda", logits_bytes=1) == (256, 9496)  # the floor
    fixed = MemoryPlan(logprob_chunk_size=512, logprob_vocab_tile=None)
    assert logprob_granularity(vocab, fixed, tokens, device="cuda") == (512, None)
    assert logprob_granularity(vocab, fixed, tokens, device="cpu") == (512, None)


def test_a_plan_for_a_budget_fits_its_log_prob_pass_into_what_the_rest_leaves():
    """plan_for_budget writes the chunk and tile it fitted into the plan; the estimate counts exactly
    chunk x tile x 12 bytes for them, and the training phase stays within the budget's limit."""
    from grpo_engine.memory.budget import plan_for_budget

    workload = Workload(prompts_per_step=4, group_size=8, prompt_tokens=128, completion_tokens=1024)
    choice = plan_for_budget("qwen2.5-1.5b", workload, 8, margin=0.15)
    chunk, tile = choice.plan.logprob_chunk_size, choice.plan.logprob_vocab_tile
    assert isinstance(chunk, int) and isinstance(tile, int)
    m = choice.plan.micro_batch_size
    assert choice.estimate.parts["logprob_tile"] == min(chunk, m * 1024) * tile * 12
    assert choice.estimate.phases["training"] <= 8 / 1.15 * GIB
    again = estimate_memory("qwen2.5-1.5b", choice.plan, workload)  # the plan's numbers, not "auto"
    assert again.parts["logprob_tile"] == choice.estimate.parts["logprob_tile"]
    roomy = plan_for_budget("qwen2.5-1.5b", workload, 140, margin=0.15).plan
    assert (roomy.logprob_chunk_size, roomy.logprob_vocab_tile) == (roomy.micro_batch_size * 1024, 151_936)
