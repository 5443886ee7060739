"""Tiny offline models and tokenizers for tests: no network, a few thousand parameters."""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list(string.digits + string.ascii_letters + " +-*/=?.,:;!()<>[]{}\\$#_'\"\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every printable character is one token."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 32, layers: int = 2) -> LlamaForCausalLM:
    """A random-init Llama-shaped causal LM, small enough for CPU unit tests."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model.eval()


def static_decode_case(hidden: int = 64):
    """A tiny Llama and the arguments of a static decoding call (2 prompts of 6 tokens, 3 rows each, 8
    new tokens at temperature 0.9), with the eager path's (ids, log-probs) drawn after seed 0:
    ``model, ids, mask, kwargs, eager``."""
    from grpo_engine.sampling.decode import TokenDraw
    from grpo_engine.sampling.static import decode_static

    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden=hidden)
    ids = torch.randint(4, len(tok), (2, 6))
    mask = torch.ones_like(ids, dtype=torch.bool)
    kw = dict(repeats=3, max_new_tokens=8, eos_ids=[1], pad_id=0, draw=TokenDraw(temperature=0.9))
    torch.manual_seed(0)
    return model, ids, mask, kw, decode_static(model, ids, mask, **kw)


class ReplayByRunning:
    """A stand-in for ``static.CudaGraphCapture`` on the CPU: ``capture(run)`` records nothing and returns a
    graph whose ``replay()`` calls ``run`` (counting); ``graphs`` lists every graph captured."""

    class Graph:
        def __init__(self, run) -> None:
            self.run, self.replays = run, 0

        def replay(self) -> None:
            self.replays += 1
            self.run()

    def __init__(self, device=None) -> None:
        self.graphs: list[ReplayByRunning.Graph] = []

    def side_stream(self):
        import contextlib

        return contextlib.nullcontext()

    def capture(self, run) -> ReplayByRunning.Graph:
        self.graphs.append(self.Graph(run))
        return self.graphs[-1]

    def recover(self) -> None:
        pass
