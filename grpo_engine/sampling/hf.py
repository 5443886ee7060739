"""HFSampler: samples G completions per prompt from the live policy.

- Prompts are rendered by a template, tokenised once, left-padded; a prompt over ``max_prompt_tokens``
  loses the middle of its question, never the template's head (counted in ``prompts/truncated``). The
  returned ids are exactly the sampled ids (never decoded and re-tokenised); a completion ends at its
  first EOS token (kept, and counted in the loss) or is truncated at ``max_completion_tokens``.
- A transformers causal LM runs one of our two decoding paths, with an exact two-level inverse-CDF
  draw: ``decoding="dynamic"`` (:mod:`grpo_engine.sampling.decode`: a row leaves the batch at its EOS),
  or ``"static"``, ``"compiled"``, ``"cuda_graph"`` (:mod:`grpo_engine.sampling.static`: a static KV cache
  and fixed-shape steps, run as Python, through ``torch.compile`` or replayed as CUDA graphs). ``"auto"``
  takes ``dynamic`` on the CPU (measured faster there) and ``cuda_graph`` on a GPU. Under ``cuda_graph``
  the sampler keeps one :class:`~grpo_engine.sampling.static.StaticDecoding` for the run: its buffers
  sized for the most rows of a call and ``max_prompt_tokens + max_completion_tokens`` slots, the compiled
  step captured once per attended-width bucket at the first call and replayed at every later one (the
  KV cache then stays allocated between calls). Any other model is sampled with its own ``generate()``.
- ``share_prompt``: one forward over the B distinct prompts fills a KV cache that is repeated G times.
- Temperature first, then top-k / top-p. ``sampler_logprobs`` are the log-probs of the temperature-scaled
  distribution before top-k / top-p, the trainer's quantity (equal to it when top-k and top-p are off).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from grpo_engine.data.templates import PromptTemplate, default_template
from grpo_engine.sampling.compiled_products import (
    compiled_products,
    compiled_products_available,
    reducible_layers,
)
from grpo_engine.sampling.decode import (
    PhaseClock,
    TokenDraw,
    completion_mask_from_ids,
    decode,
    is_decoder_lm,
    seeded_rng,
)
from grpo_engine.sampling.merge import check_mergeable, merged_lora
from grpo_engine.sampling.packed import packable_layers, packed_linears, packing_available
from grpo_engine.sampling.settings import records_settings
from grpo_engine.sampling.static import StaticDecoding, decode_static, supports_static
from grpo_engine.types import Draws, Prompt, RolloutBatch

__all__ = ["HFSampler", "eos_token_ids", "DECODING_PATHS", "resolve_decoding"]

DECODING_PATHS = ("auto", "dynamic", "static", "compiled", "cuda_graph")


def resolve_decoding(decoding: str, model: nn.Module, device: torch.device) -> str:
    """The decoding path to run: ``decoding`` itself, or for ``"auto"`` the one meant to be faster on
    ``device`` (CUDA: ``cuda_graph``; CPU: ``dynamic``); ``dynamic`` where the static path cannot run
    the model (:func:`~grpo_engine.sampling.static.supports_static`).

    Raises:
        ValueError: an explicit static path the model or device cannot run.
    """
    if decoding not in DECODING_PATHS:
        raise ValueError(f"decoding={decoding!r} is not one of {', '.join(DECODING_PATHS)}; use 'auto'")
    why = supports_static(model)
    if decoding == "auto":
        return "cuda_graph" if device.type == "cuda" and why is None else "dynamic"
    if decoding != "dynamic" and why is not None:
        raise ValueError(f"decoding={decoding!r} needs the static path, which cannot run this model: {why}; "
                         "use decoding='dynamic' (or 'auto')")
    if decoding == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"decoding='cuda_graph' needs a CUDA device, the model is on {device}; use "
                         "'static', 'compiled' or 'auto'")
    return decoding


def _check_packable(model: nn.Module) -> None:
    """Raises ValueError unless :func:`~grpo_engine.sampling.packed.packed_linears` can pack some of
    ``model``'s layers (float32 weights on the CPU, a torch build with oneDNN)."""
    device = next(model.parameters()).device
    why = None
    if device.type != "cpu":
        why = f"the model is on {device}, and packing is for CPU decoding"
    elif not packing_available():
        why = "this torch build has no oneDNN (mkldnn) CPU backend"
    elif not packable_layers(model):
        why = "the model has no plain float32 nn.Linear large enough to pack"
    if why:
        raise ValueError(f"pack_weights_for_sampling=True: {why}; set pack_weights_for_sampling=False")


def _check_reducible(model: nn.Module, decoding: str, pack_weights: bool) -> None:
    """Raises ValueError unless :func:`~grpo_engine.sampling.compiled_products.compiled_products` can change
    the compiled decoding step of ``model`` (float32 layers on the CPU, ``decoding='compiled'``)."""
    device = next(model.parameters()).device
    why = None
    if decoding != "compiled" or pack_weights:
        why = (f"decoding={decoding!r} and pack_weights={pack_weights}: it changes only the compiled step, "
               "unpacked (decoding='compiled', pack_weights=False)")
    elif device.type != "cpu":
        why = f"the model is on {device}, and the products are compiled for CPU decoding"
    elif not compiled_products_available():
        why = f"torch {torch.__version__} lacks inductor's inductor_force_stride_order"
    elif not reducible_layers(model):
        why = "the model has no plain float32 nn.Linear"
    if why:
        raise ValueError(f"compiled_products=True: {why}; set compiled_products=False")


class _TemperatureRecorder(LogitsProcessor):
    """For a model's own ``generate()``: divides logits by the temperature and records the
    log-prob of each sampled token."""

    def __init__(self, temperature: float, prompt_width: int, record: bool = True) -> None:
        self.temperature = temperature
        self.prompt_width = prompt_width
        self.record = record  # without it, only the temperature is applied (no log-softmax per step)
        self._last: Tensor | None = None  # [N, V] log-softmax of the previous step
        self.logprobs: list[Tensor] = []  # each [N]

    def _collect(self, sampled: Tensor) -> None:
        if self._last is not None:
            self.logprobs.append(self._last.gather(-1, sampled[:, None]).squeeze(-1))

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if input_ids.shape[1] > self.prompt_width:
            self._collect(input_ids[:, -1])
        scores = scores.float() / self.temperature
        if self.record:
            self._last = torch.log_softmax(scores, dim=-1)
        return scores

    def finish(self, sequences: Tensor) -> Tensor:
        """[N, C] recorded log-probs once generation returned ``sequences``."""
        if sequences.shape[1] > self.prompt_width + len(self.logprobs):
            self._collect(sequences[:, -1])
        self._last = None
        return (torch.stack(self.logprobs, dim=1) if self.logprobs
                else sequences.new_zeros(sequences.shape[0], 0))


def eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS ids, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("neither the model's generation_config nor the tokenizer defines an EOS token; "
                         "set tokenizer.eos_token so completions can end")
    return [eos] if isinstance(eos, int) else list(eos)


class HFSampler:
    """Samples with our decoding loop (a model's own ``generate()`` if it is not a transformers
    causal LM); the Sampler protocol.

    Args:
        model: the policy (updated in place by the trainer, so samples are always on-policy).
        tokenizer: its tokenizer.
        template: renders a Prompt to text; defaults to the chat template when the tokenizer has one.
        max_prompt_tokens: a longer prompt loses the middle of its question (:meth:`truncated`).
        max_completion_tokens: sampling stops here.
        temperature: the default sampling temperature (a ``sample()`` call may pass another).
        top_p, top_k: sampling settings (top_p=1 and top_k=0 are off).
        return_logprobs: also report the sampled tokens' log-probs (costs one log-softmax per step).
        share_prompt: prefill each distinct prompt once and repeat its KV cache across the group
            (falls back to a prefill per row for models whose cache cannot be repeated).
        merge_lora: sample with each LoRA delta merged into a temporary copy of its base weight
            (:func:`~grpo_engine.sampling.merge.merged_lora`): faster decoding for one copy of the
            adapted weights while sampling; float32 base weights only.
        decoding: ``"auto"``, ``"dynamic"``, ``"static"``, ``"compiled"`` or ``"cuda_graph"`` (see
            the module docstring and :func:`resolve_decoding`).
        pack_weights: CPU only: sample with the large float32 linear weights packed into oneDNN's
            layout (:func:`~grpo_engine.sampling.packed.packed_linears`): the trained weights at every
            call, the frozen ones (LoRA's base, unless ``merge_lora``) once, their copies kept.
        compiled_products: CPU, ``decoding="compiled"`` only: the compiled step computes the float32
            linear layers' products in its own loops instead of calling BLAS
            (:func:`~grpo_engine.sampling.compiled_products.compiled_products`).
        keep_decoder: ``decoding="cuda_graph"``: keep the static decoder, its compiled step and CUDA graphs
            from one call to the next (module docstring); False builds and captures one per call, and
            frees its KV cache after it. Not kept under ``merge_lora``, whose merged weights are new
            tensors at every call (a graph would read freed memory).
        compile_step: ``decoding="cuda_graph"`` with ``keep_decoder``: capture the decoding step compiled by
            ``torch.compile`` (two compiles at the first call, tens of seconds on a GPU), else the eager step.

    Each ``sample()`` call seeds its token draws with ``draws.seed`` (by default one number taken
    from torch's global RNG, so ``torch.manual_seed`` fixes the samples), each step drawing for every
    row of the call; a row's draw is keyed by its place among the rows of ``draws.total_prompts``
    (under data parallel, every rank's share of the call), so K ranks draw what one process draws.

    After each ``sample()`` call, ``last_decoding`` holds the path that ran (and, if a CUDA graph
    could not be captured, why), and ``last_clock`` the prefill / decode times (``seconds()``).

    ``settings_given`` names the sampling settings the constructor was given (the others hold their
    defaults): passed to ``GRPOTrainer(sampler=...)``, a setting given here or in ``GRPOConfig`` holds on
    both sides, and one given in both with different values is an error
    (:func:`~grpo_engine.sampling.settings.agreed_config`).

    Example:
        >>> # sampler = HFSampler(model, tokenizer, max_completion_tokens=64)
        >>> # batch = sampler.sample([Prompt("What is 2+2?", "4")], group_size=8)
    """

    @records_settings
    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        template: PromptTemplate | None = None,
        max_prompt_tokens: int = 512,
        max_completion_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        return_logprobs: bool = True,
        share_prompt: bool = True,
        merge_lora: bool = False,
        decoding: str = "auto",
        pack_weights: bool = False,
        compiled_products: bool = False,
        keep_decoder: bool = True,
        compile_step: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.template = template if template is not None else default_template(tokenizer)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_completion_tokens = max_completion_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.return_logprobs = return_logprobs
        self.share_prompt = share_prompt
        self.merge_lora = merge_lora
        if decoding not in DECODING_PATHS:
            raise ValueError(f"decoding={decoding!r} is not one of {', '.join(DECODING_PATHS)}; use 'auto'")
        self.decoding = decoding
        self.pack_weights = pack_weights
        # the packed copies of the frozen weights (LoRA's base), kept between calls; under merge_lora the
        # adapted weights are new tensors at every call, so nothing is kept
        self._kept_packs: dict | None = None if merge_lora else {}
        if pack_weights:
            _check_packable(model)
        self.compiled_products = compiled_products
        if compiled_products:
            _check_reducible(model, decoding, pack_weights)
        self.keep_decoder, self.compile_step = keep_decoder and not merge_lora, compile_step
        self.decoding_kept: StaticDecoding | None = None  # cuda_graph: the run's decoder (keep_decoder)
        self.last_clock: PhaseClock | None = None  # the last sample() call's prefill / decode marks
        # the last call's decoding path ("path"), and a CUDA-graph capture error
        self.last_decoding: dict = {}
        self.last_truncated, self._warned_truncation = 0, False  # prompts cut to max_prompt_tokens
        if merge_lora:
            check_mergeable(model)
        self.eos_ids = eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]

    def prompt_tokens(self, prompt: Prompt) -> list[int]:
        """The token ids of the rendered prompt, whole (before any truncation)."""
        return self.encode_text(self.template.render(prompt, self.tokenizer))

    def encode_text(self, text: str) -> list[int]:
        """The ids of a rendered prompt ``text``: the tokenizer's special tokens added, except a second BOS
        token where the chat template already wrote one."""
        bos = self.tokenizer.bos_token
        return self.tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]

    def truncated(self, prompt: Prompt, ids: list[int]) -> list[int]:
        """``ids`` cut to ``max_prompt_tokens``: the template's head and tail (what an empty question
        renders to) are kept whole, and the question loses its middle, keeping its start and end."""
        limit = self.max_prompt_tokens
        if len(ids) <= limit:
            return ids
        content = "" if isinstance(prompt.content, str) else tuple(
            {**m, "content": ""} if m is prompt.content[-1] else m for m in prompt.content)
        scaffold = self.prompt_tokens(dataclasses.replace(prompt, content=content))
        head = 0
        while head < min(len(ids), len(scaffold)) and ids[head] == scaffold[head]:
            head += 1
        tail = 0
        while tail < min(len(ids), len(scaffold)) - head and ids[-1 - tail] == scaffold[-1 - tail]:
            tail += 1
        budget = limit - head - tail
        if budget < 2:  # the template alone is too long: keep the end
            return ids[-limit:]
        middle = ids[head:len(ids) - tail]
        return (ids[:head] + middle[:budget - budget // 2] + middle[len(middle) - budget // 2:]
                + ids[len(ids) - tail:])

    def encode_prompts(self, prompts: Sequence[Prompt]) -> tuple[Tensor, Tensor]:
        """Left-padded ids [B, P] and mask [B, P] of the rendered prompts; a prompt longer than
        ``max_prompt_tokens`` is cut by :meth:`truncated` (``last_truncated`` counts them)."""
        whole = [self.prompt_tokens(p) for p in prompts]
        rows = [self.truncated(p, r) for p, r in zip(prompts, whole)]
        self.last_truncated = sum(len(r) > self.max_prompt_tokens for r in whole)
        if self.last_truncated and not self._warned_truncation:
            self._warned_truncation = True
            warnings.warn(f"{self.last_truncated} prompt(s) of a batch are longer than max_prompt_tokens="
                          f"{self.max_prompt_tokens}: their question lost its middle (the template's head "
                          "and tail kept); raise max_prompt_tokens, or set "
                          "GRPOConfig(overlong_prompts='drop' or 'error')",
                          stacklevel=3)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, row in enumerate(rows):
            if row:
                ids[i, width - len(row):] = torch.tensor(row)
                mask[i, width - len(row):] = True
        return ids, mask

    @torch.no_grad()
    def sample(self, prompts: Sequence[Prompt], *, group_size: int, temperature: float | None = None,
               draws: Draws | None = None) -> RolloutBatch:
        """Draws ``group_size`` completions per prompt at ``temperature`` (default: the sampler's);
        rows ``b*G .. b*G+G-1`` belong to prompt b. ``draws``: the seed and place of the call's token
        draws (default: seeded from torch's global RNG, these prompts alone)."""
        if not prompts:
            raise ValueError("sample() got no prompts; pass at least one Prompt")
        temperature = self.temperature if temperature is None else temperature
        draws = draws if draws is not None else Draws.seeded()
        device = next(self.model.parameters()).device
        ids, mask = self.encode_prompts(prompts)
        ids, mask = ids.to(device), mask.to(device)
        prompt_ids = ids.repeat_interleave(group_size, dim=0)  # [N, P]
        prompt_mask = mask.repeat_interleave(group_size, dim=0)  # [N, P]
        was_training = self.model.training
        self.model.eval()
        try:
            with (merged_lora(self.model) if self.merge_lora else contextlib.nullcontext(),
                  packed_linears(self.model, rows=len(prompts) * group_size, keep=self._kept_packs)
                  if self.pack_weights else contextlib.nullcontext(),
                  compiled_products(self.model) if self.compiled_products else contextlib.nullcontext()):
                if is_decoder_lm(self.model):
                    shared = self.share_prompt and group_size > 1
                    self.last_clock = PhaseClock(device)
                    self.last_clock.mark("start")
                    with seeded_rng(draws.seed, device):  # the call's draws depend on it alone
                        completion_ids, logprobs = self._decode(
                            ids if shared else prompt_ids, mask if shared else prompt_mask,
                            repeats=group_size if shared else 1, max_new_tokens=self.max_completion_tokens,
                            eos_ids=self.eos_ids, pad_id=self.pad_id, draw=self.token_draw(temperature),
                            clock=self.last_clock, row_offset=draws.first_prompt * group_size,
                            total_rows=draws.total(len(prompts)) * group_size)
                else:
                    completion_ids, logprobs = self._generate(prompt_ids, prompt_mask, temperature)
        finally:
            self.model.train(was_training)
        completion_mask, is_truncated = completion_mask_from_ids(completion_ids, self.eos_ids)
        completion_ids = completion_ids.masked_fill(~completion_mask, self.pad_id)
        logprobs = logprobs.masked_fill(~completion_mask, 0.0) if logprobs is not None else None
        texts = tuple(self.tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(completion_ids, completion_mask)], skip_special_tokens=True
        ))
        return RolloutBatch(
            prompts=tuple(prompts), group_size=group_size, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            completion_ids=completion_ids, completion_mask=completion_mask, is_truncated=is_truncated,
            texts=texts, sampler_logprobs=logprobs, metrics={"prompts/truncated": float(self.last_truncated)},
        )

    def _decode(self, ids: Tensor, mask: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
        """Completions of left-padded ``ids`` / ``mask`` on the decoding path in force (``decode``'s
        keywords); ``last_decoding`` says which ran."""
        path = resolve_decoding(self.decoding, self.model, ids.device)
        self.last_decoding = {"path": path, "capture_error": None}
        if path == "dynamic":
            return decode(self.model, ids, mask, **kwargs)
        if path == "cuda_graph" and self.keep_decoder:
            decoding = self.kept_decoder(ids.shape[0] * kwargs["repeats"], ids.shape[1], kwargs["draw"])
            return decoding(ids, mask, **kwargs, info=self.last_decoding)
        return decode_static(self.model, ids, mask, **kwargs, mode="eager" if path == "static" else path,
                             info=self.last_decoding)

    def kept_decoder(self, rows: int, prompt_tokens: int, draw: TokenDraw) -> StaticDecoding:
        """The run's CUDA-graph decoder, built at the first call (or when a call has more rows, a longer
        prompt or other draw settings than it was built for, which captures again) for the most rows yet and
        ``max_prompt_tokens + max_completion_tokens`` slots."""
        kept = self.decoding_kept
        settings = dict(max_new_tokens=self.max_completion_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                        draw=draw)
        if kept is not None and kept.fits(rows=rows, prompt_tokens=prompt_tokens, **settings):
            return kept
        rows = max(rows, kept.decoder.rows if kept is not None else 0)
        kept = self.decoding_kept = None  # its buffers and graphs freed before the new ones are allocated
        self.decoding_kept = StaticDecoding(self.model, rows=rows,
                                            prompt_tokens=max(prompt_tokens, self.max_prompt_tokens),
                                            mode="cuda_graph", compile_step=self.compile_step,
                                            concat_lora=True, **settings)
        return self.decoding_kept

    def release_decoder(self) -> None:
        """Frees the kept decoder (its KV cache and CUDA graphs); the next call builds and captures anew."""
        self.decoding_kept = None

    def token_draw(self, temperature: float) -> TokenDraw:
        """The token draw of the sampler's settings at ``temperature``; 0 is greedy decoding (the argmax,
        top-k and top-p aside; its log-probs are the untempered distribution's), as in vLLM."""
        if temperature == 0:
            return TokenDraw(greedy=True, logprobs=self.return_logprobs)
        return TokenDraw(temperature=temperature, top_k=self.top_k, top_p=self.top_p,
                         logprobs=self.return_logprobs)

    def _generate(self, prompt_ids: Tensor, prompt_mask: Tensor,
                  temperature: float) -> tuple[Tensor, Tensor | None]:
        """Completion ids [N, C] and log-probs from the model's own ``generate()`` (a model that is not
        a transformers causal LM)."""
        recorder = _TemperatureRecorder(temperature, prompt_ids.shape[1], record=self.return_logprobs)
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=self.max_completion_tokens,
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id, use_cache=True,
        )
        sequences = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(),
                                        generation_config=config,
                                        logits_processor=LogitsProcessorList(
                                            [recorder, *self.token_draw(temperature).warpers]))
        return (sequences[:, prompt_ids.shape[1]:],
                recorder.finish(sequences) if self.return_logprobs else None)
