"""Random-init models, a word-level tokenizer and a cheap reward, shared by the benchmark harness.

Nothing here downloads anything: the models are random-init Llama / Qwen2 shapes built from a
config, the tokenizer is built in memory. torch is imported only by the functions that build models,
so that a benchmark's parent process (which only starts workers) does not pay for it.

- ``word_tokenizer(vocab_size)``: one word per model id (``<pad>``, ``<unk>``, ``t2`` ...
  ``t{V-1}``), so any id a random-init model samples decodes to text, plus ``<eos>`` at id V,
  *outside* the model's vocabulary. The model can never sample it, so every completion runs to
  ``max_completion_tokens`` and both engines do exactly the same work.
- ``build_model(shape, ...)``: the random-init model with that EOS id in its generation config.
- ``make_prompts``: prompts of exactly ``prompt_tokens`` words each (no BOS, no template).
- ``hash_score``: a deterministic reward in [0, 1) from a CRC of the completion text, so every
  group has a non-zero reward spread (non-zero advantages) without any model or verifier.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

__all__ = ["ModelShape", "SHAPES", "word_tokenizer", "build_model", "make_prompts", "hash_score",
           "count_params"]

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a random-init decoder (Llama or Qwen2 family)."""

    family: str  # "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    max_positions: int = 4096


SHAPES: dict[str, ModelShape] = {
    # a few hundred thousand parameters: the test suite's smoke preset
    "micro": ModelShape("llama", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=512,
                        tie_embeddings=False, max_positions=256),
    # the CPU smoke run of the GPU presets, in seconds: hidden 64 because bitsandbytes' CPU 4-bit kernels need
    # rows of at least one 64-weight block; Llama-shaped because its CPU 4-bit path fails on a biased layer
    # in training after an inference pass (bitsandbytes 0.50: `result += bias` on a leaf view)
    "smoke": ModelShape("llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512,
                        tie_embeddings=False, max_positions=256),
    # 5.0M parameters, Llama-shaped: under a second per GRPO step (B=2, G=4, 32+64 tokens) on one core
    "llama-small": ModelShape("llama", hidden=256, layers=4, heads=8, kv_heads=4, intermediate=688,
                              vocab=4096, tie_embeddings=False, max_positions=1024),
    # Qwen2.5's 151,936-token vocabulary on a tiny trunk: the embedding and the logits dominate
    "qwen2-logits": ModelShape("qwen2", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384,
                               vocab=151_936, tie_embeddings=True, max_positions=1024),
    # Qwen2.5-0.5B and -1.5B (config.json of the released models; tied embeddings)
    "qwen2.5-0.5b": ModelShape("qwen2", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                               vocab=151_936, tie_embeddings=True, max_positions=32_768),
    "qwen2.5-1.5b": ModelShape("qwen2", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960,
                               vocab=151_936, tie_embeddings=True, max_positions=32_768),
    # Qwen2.5-7B (untied embeddings)
    "qwen2.5-7b": ModelShape("qwen2", hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18_944,
                             vocab=152_064, tie_embeddings=False, max_positions=32_768),
}

def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``vocab_size`` model ids plus an unreachable ``<eos>`` (id V).

    Example:
        >>> tok = word_tokenizer(16)
        >>> tok("t3 t15")["input_ids"], tok.decode([3, 15]), tok.eos_token_id
        ([3, 15], 't3 t15', 16)
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, UNK: 1, **{f"t{i}": i for i in range(2, vocab_size)}, EOS: vocab_size}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, unk_token=UNK, eos_token=EOS)
    tok.padding_side = "left"
    return tok


def build_model(shape: ModelShape | str, *, seed: int = 0, dtype: str = "float32", device: str = "cpu"):
    """The random-init causal LM of ``shape``, in ``dtype`` on ``device``, in eval mode.

    Its generation config ends completions only at id ``shape.vocab`` (the tokenizer's ``<eos>``),
    which the model cannot produce: every completion is full-length. (The model config itself has
    no EOS id, since transformers warns about an id outside the vocabulary there.)
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = SHAPES[shape] if isinstance(shape, str) else shape
    common = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, max_position_embeddings=shape.max_positions,
        tie_word_embeddings=shape.tie_embeddings, pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )
    if shape.family == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif shape.family == "qwen2":
        config, cls = Qwen2Config(rope_theta=1_000_000.0, rms_norm_eps=1e-6, **common), Qwen2ForCausalLM
    else:
        raise ValueError(f"family={shape.family!r} is not 'llama' or 'qwen2'")
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # initialise directly in the target dtype (no fp32 copy)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = shape.vocab
    model.generation_config.bos_token_id = None
    return model.eval()


def make_prompts(count: int, prompt_tokens: int, vocab_size: int, *, seed: int = 0) -> list[str]:
    """``count`` prompts of exactly ``prompt_tokens`` words of ``word_tokenizer(vocab_size)``."""
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(2, vocab_size)}" for _ in range(prompt_tokens)) for _ in range(count)]


def hash_score(text: str) -> float:
    """A deterministic pseudo-random reward in [0, 1): CRC32 of the text."""
    return (zlib.crc32(text.encode()) % 10_007) / 10_007


def count_params(shape: ModelShape | str) -> dict[str, int]:
    """Parameters of a shape: total (tied embeddings counted once) and without the embeddings.

    Example:
        >>> count_params("qwen2.5-0.5b")["total"]
        494032768
    """
    s = SHAPES[shape] if isinstance(shape, str) else shape
    head_dim = s.hidden // s.heads
    kv = s.kv_heads * head_dim
    attn = s.hidden * s.hidden * 2 + s.hidden * kv * 2  # q, o, k, v
    if s.family == "qwen2":
        attn += s.hidden + 2 * kv  # q, k, v biases
    mlp = 3 * s.hidden * s.intermediate
    per_layer = attn + mlp + 2 * s.hidden  # two RMSNorms
    trunk = s.layers * per_layer + s.hidden  # final norm
    embed = s.vocab * s.hidden
    total = trunk + embed + (0 if s.tie_embeddings else embed)
    return {"total": total, "non_embedding": trunk, "embedding": embed}
