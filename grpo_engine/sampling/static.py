"""The fixed-shape decoding path: a static KV cache, one-token steps of fixed shape, on a GPU CUDA graphs
captured once per run and replayed at every later call.

- :class:`StaticDecoding` holds a :class:`~grpo_engine.sampling.static_step.StaticDecoder` (the KV cache,
  the 4D mask, token / position / slot / t, uniforms, temperature, done / bad flags, output ids and
  log-probs), sized once for the most rows and the longest prompt + completion of the run, and refreshed
  in place at each call (a call with fewer rows or a shorter prompt fits: the other slots are masked off,
  the other rows finished). The host reads the EOS flags every ``check_every`` tokens; a finished row
  keeps computing, with padding for its tokens and 0 for its log-probs.
- Each step attends over the slots written so far rounded up to a bucket
  (:func:`~grpo_engine.sampling.static_step.attention_buckets`, multiples of 128), a step runner per
  bucket, made when a step first needs it and kept for the run.
- ``mode``: ``"eager"`` (Python; the same tokens as the dynamic loop), ``"compiled"`` (``torch.compile``
  over the whole width, the later steps calling its graph directly; the CPU's), ``"cuda_graph"``: per
  bucket, the compiled step (norm, RoPE, softmax and LoRA fused by inductor, the width symbolic after the
  first bucket) captured as a CUDA graph; if it cannot be, the eager step's graph; if that cannot be
  either, eager steps, with a warning. The uniforms are drawn outside the graphs, one draw per step for
  every row of the whole step, so the random stream is the dynamic loop's whatever the call's rows.
- The graphs read the weights in place: an optimizer step updates the parameters in place, so a replay
  samples from the new policy. What replaces a weight tensor instead (``merge_lora_for_sampling``'s
  temporary merged copies, ``model.to(...)``, loading a state dict by assignment, FSDP2 re-gathering into
  new storage) or switches peft's adapters would leave a graph reading freed memory: each call compares the
  model's tensors' addresses and peft's switches with those at capture, and captures again when they
  differ (with a warning; the sampler does not keep a decoder under ``merge_lora``).
- Under LoRA (``concat_lora``) the A matrices of q/k/v and of gate/up run as one product each
  (:mod:`grpo_engine.sampling.lora_concat`), the copy refreshed in place at each call.
Needs a Llama / Mistral / Qwen2 / Qwen3-family decoder with full attention in ``sdpa`` or ``eager`` mode
(:func:`supports_static`); the sampler falls back to the dynamic loop otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from grpo_engine.ops.attention import (
    attention_implementation,
    attention_mask,
    position_ids_from_mask,
    prompt_attention,
    supports_static,
)
from grpo_engine.sampling.compiled_step import compiled, first_compiled_call, later_calls
from grpo_engine.sampling.draw import BAD_DISTRIBUTION, PhaseClock, TokenDraw, draw_uniforms
from grpo_engine.sampling.lora_concat import ConcatenatedLoRA, lora_switches
from grpo_engine.sampling.static_step import (
    StaticDecoder,
    StaticKVCache,
    attention_buckets,
    grouped_attention,
    static_cache_bytes,
)

__all__ = ["StaticDecoding", "StaticKVCache", "StaticDecoder", "CudaGraphCapture", "decode_static",
           "supports_static", "static_cache_bytes", "grouped_attention", "attention_buckets",
           "attention_implementation", "attention_mask", "prompt_attention", "BUCKET_TOKENS", "load"]

Mode = Literal["eager", "compiled", "cuda_graph"]
MODES = ("eager", "compiled", "cuda_graph")
ATTENTION = "grpo_engine_grouped"  # the name grouped_attention is registered under in transformers
BUCKET_TOKENS = 128  # the attended width grows by this many slots (eager and CUDA-graph steps)


def _grouped_attention(model: nn.Module):
    """Runs the block with the model's attention layers calling :func:`grouped_attention`."""
    return attention_implementation(model.config, ATTENTION, grouped_attention)


class CudaGraphCapture:
    """Captures steps as CUDA graphs on one side stream, every graph in one shared memory pool (a step's
    temporaries die within it, so graphs replayed one after another never overlap). Unlike
    ``torch.cuda.graph``'s context it neither synchronises the device nor empties the allocator's cache.

    The static runner calls :meth:`side_stream` (warm-up), :meth:`capture` and, after a failure,
    :meth:`recover`; tests pass an object with the same three methods.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"mode='cuda_graph' needs the model on a CUDA device, not {device}; use 'eager' "
                             "or 'compiled' on the CPU")
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    def capture(self, run: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """The kernels ``run`` launches, recorded (not run) as a graph; ``replay()`` runs them."""
        graph = torch.cuda.CUDAGraph()
        with self.side_stream():
            graph.capture_begin(pool=self.pool)
            try:
                run()
            except BaseException:
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            graph.capture_end()
        return graph

    def recover(self) -> None:
        torch.cuda.synchronize()


def _fingerprint(model: nn.Module) -> tuple:
    """What a captured or directly called step has baked in: the address of every parameter and buffer, the
    model's mode and attention implementation, and peft's switches."""
    return (model.training, getattr(model.config, "_attn_implementation", None),
            tuple(t.data_ptr() for t in model.parameters()), tuple(t.data_ptr() for t in model.buffers()),
            lora_switches(model))


def _draw_key(draw: TokenDraw) -> tuple:
    """The settings of a draw a step bakes in (the temperature is a buffer, refreshed per call)."""
    warpers = tuple((type(w).__name__, tuple(sorted(vars(w).items()))) for w in draw.warpers)
    return draw.greedy, draw.logprobs, warpers


def _autocast(device: torch.device) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is on for ``device``, and its dtype: a step's casts and the cache's dtypes follow."""
    on = torch.is_autocast_enabled(device.type)
    return on, torch.get_autocast_dtype(device.type) if on else None


def _bucket_step(decoder: StaticDecoder, width: int) -> None:
    """The step at attended ``width``: the function the CUDA-graph runner compiles (its own dynamo cache)."""
    decoder.step(width)


def _restore(buffers: list[Tensor], saved: list[Tensor]) -> None:
    for buffer, value in zip(buffers, saved):
        buffer.copy_(value)


def load(decoder: StaticDecoder, ids: Tensor, mask: Tensor, *, repeats: int, temperature: float) -> int:
    """Loads a call's left-padded prompts ``ids`` / ``mask`` [B, P] into ``decoder``
    (:meth:`StaticDecoder.load`): prefills each distinct prompt's head once (outside the grouped attention:
    the model's own) and returns the call's rows. The first call allocates the cache, each layer's keys
    and values in the dtypes the model wrote them (under autocast the keys, rotated by a float32 RoPE, may
    be float32 and the values bfloat16)."""
    head = _prefill(decoder, ids, mask) if ids.shape[1] > 1 else None
    if not decoder.cache.keys:  # the first call: the layers' dtypes are those the model wrote
        decoder.cache.allocate_like(head if head is not None else _probe(decoder))
    return decoder.load(ids, mask, head, repeats=repeats, temperature=temperature)


def _prefill(decoder: StaticDecoder, ids: Tensor, mask: Tensor) -> StaticKVCache:
    """The keys and values of every prompt token but the last, one row per distinct prompt."""
    head, head_mask = StaticKVCache(ids.shape[0], ids.shape[1] - 1, ids.device), mask[:, :-1]
    allowed = attention_mask(prompt_attention(head_mask), decoder.eager_attention, decoder.dtype)
    decoder.forward(ids[:, :-1], allowed, position_ids_from_mask(head_mask), head, logits_to_keep=1)
    return head


def _probe(decoder: StaticDecoder) -> StaticKVCache:
    """A cache one padding token wrote (one-token prompts: no prefill tells the layers' dtypes)."""
    device = decoder.token.device
    probe, one = StaticKVCache(1, 1, device), torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    decoder.forward(torch.full((1, 1), decoder.pad_id, device=device),
                    attention_mask(one, decoder.eager_attention, decoder.dtype),
                    torch.zeros(1, 1, dtype=torch.long, device=device), probe, logits_to_keep=1)
    return probe


class StaticDecoding:
    """Static decoding whose buffers, compiled step and CUDA graphs live from one call to the next (see the
    module docstring); :meth:`__call__` has :func:`decode_static`'s contract.

    Args:
        model: the decoder LM (eval mode while it samples).
        rows, prompt_tokens, max_new_tokens: the most rows, prompt tokens and new tokens of any call.
        eos_ids, pad_id, draw: every call's (the draw's temperature may change per call).
        mode: ``"eager"``, ``"compiled"`` or ``"cuda_graph"``.
        bucket_tokens: the attended width's step (``"eager"`` / ``"cuda_graph"``; None: the whole width).
        compile_step: ``"cuda_graph"``: capture the compiled step (else the eager one).
        concat_lora: run the LoRA A products of sibling layers as one (:class:`ConcatenatedLoRA`).
        capture: how graphs are captured (default :class:`CudaGraphCapture` of the model's device).

    Example:
        >>> # decoding = StaticDecoding(model, rows=32, prompt_tokens=128, max_new_tokens=512, eos_ids=[2],
        >>> #                           pad_id=0, draw=TokenDraw(), mode="cuda_graph")
        >>> # ids, logprobs = decoding(prompt_ids, prompt_mask, repeats=8, max_new_tokens=512, eos_ids=[2],
        >>> #                          pad_id=0, draw=TokenDraw(temperature=0.9))  # the first call captures
    """

    def __init__(self, model: nn.Module, *, rows: int, prompt_tokens: int, max_new_tokens: int,
                 eos_ids: Sequence[int], pad_id: int, draw: TokenDraw, mode: Mode = "eager",
                 bucket_tokens: int | None = BUCKET_TOKENS, compile_step: bool = True,
                 concat_lora: bool = False, capture=None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {', '.join(MODES)}")
        self.model, self.mode = model, mode
        self.device = next(model.parameters()).device
        if capture is None and mode == "cuda_graph":
            capture = CudaGraphCapture(self.device)
        self.capture = capture
        self.settings = (tuple(eos_ids), pad_id, _draw_key(draw), _autocast(self.device))
        self.decoder = StaticDecoder(model, rows=rows, prompt_tokens=prompt_tokens,
                                     max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, draw=draw)
        # the last token fed sits at slot P + C - 2, so no step reads the last slot: every bucket is a strict
        # slice (a whole-width one would be contiguous, and the compiled step specialised to it once more).
        # The compiled path specialises on every shape (no buckets): one compile per call shape
        size = None if mode == "compiled" else bucket_tokens
        self.buckets = attention_buckets(self.decoder.width - 1, size)
        self.compile_step = compile_step and mode == "cuda_graph"
        self.concat_lora = concat_lora
        self.lora = ConcatenatedLoRA(model) if concat_lora else None
        self.steps: dict[int, tuple[Callable[[], object], bool]] = {}  # width -> (run one step, direct call)
        self.fingerprint: tuple | None = None
        self.captures = 0  # graphs captured over the run
        self.capture_error: str | None = None  # why eager steps run instead of graphs
        self.compile_error: str | None = None  # why the graphs hold the eager step

    def fits(self, *, rows: int, prompt_tokens: int, max_new_tokens: int, eos_ids: Sequence[int], pad_id: int,
             draw: TokenDraw) -> bool:
        """Whether a call of these shapes and settings can run on this decoder."""
        d = self.decoder
        return (rows <= d.rows and prompt_tokens <= d.prompt_tokens and max_new_tokens <= d.max_new_tokens
                and (tuple(eos_ids), pad_id, _draw_key(draw), _autocast(self.device)) == self.settings)

    @torch.no_grad()
    def __call__(self, ids: Tensor, mask: Tensor, *, repeats: int, max_new_tokens: int,
                 eos_ids: Sequence[int], pad_id: int, draw: TokenDraw, check_every: int | None = None,
                 clock: PhaseClock | None = None, info: dict | None = None, row_offset: int = 0,
                 total_rows: int | None = None) -> tuple[Tensor, Tensor | None]:
        rows = ids.shape[0] * repeats
        if not self.fits(rows=rows, prompt_tokens=ids.shape[1], max_new_tokens=max_new_tokens,
                         eos_ids=eos_ids, pad_id=pad_id, draw=draw):
            raise ValueError(f"a call of {rows} rows x {ids.shape[1]} + {max_new_tokens} tokens, or with "
                             "other settings (EOS, padding, greedy, log-probs, top-k / top-p, autocast), "
                             "does not fit this static decoder; build another (StaticDecoding.fits says "
                             "which fit)")
        self._follow_model()
        if self.lora is not None:
            self.lora.refresh()  # the adapters' new values, into the copy the steps read
        rows = load(self.decoder, ids, mask, repeats=repeats, temperature=draw.temperature)
        captured = self.captures
        if clock is not None:
            clock.mark("prefill")
        check_every = check_every or (16 if self.device.type == "cuda" else 1)
        direct = self._decode(ids.shape[1], rows, max_new_tokens, draw, check_every, (row_offset, total_rows))
        if clock is not None:
            clock.mark("decode")  # (a call that captures counts its captures here)
        if info is not None:
            graphs = self.mode == "cuda_graph" and self.capture_error is None
            step = "compiled" if self.compile_step and self.compile_error is None else "eager"
            info.update(path="cuda_graph" if graphs else "static" if self.mode != "compiled" else "compiled",
                        capture_error=self.capture_error, compile_error=self.compile_error,
                        graph_step=step if graphs else None, captures=self.captures - captured,
                        direct_steps=direct)
        logprobs = self.decoder.logprobs
        return (self.decoder.ids[:rows, :max_new_tokens].clone(),
                logprobs[:rows, :max_new_tokens].clone() if logprobs is not None else None)

    def _follow_model(self) -> None:
        """Forgets every captured graph and direct call when a weight moved or peft's switches changed."""
        now = _fingerprint(self.model)
        if self.fingerprint is not None and now != self.fingerprint and self.steps:
            warnings.warn("the model's weight tensors moved or its LoRA adapters were switched since the "
                          "decoding step was captured; capturing it again (a weight replaced at every call, "
                          "as merge_lora_for_sampling does, captures at every call)", stacklevel=3)
            self.steps.clear()
            self.lora = ConcatenatedLoRA(self.model) if self.concat_lora else None
        self.fingerprint = now

    def _decode(self, prompt_tokens: int, rows: int, max_new_tokens: int, draw: TokenDraw, check_every: int,
                place: tuple[int, int | None]) -> int:
        """Runs the call's steps; returns how many called a compiled graph directly."""
        decoder, direct_steps = self.decoder, 0
        with (_grouped_attention(self.model), contextlib.ExitStack() as stack,
              self.lora.installed() if self.lora is not None else contextlib.nullcontext()):
            for t in range(max_new_tokens):
                width = next(w for w in self.buckets if w >= prompt_tokens + t)  # slots 0 .. P-1+t
                if draw.needs_uniforms:
                    decoder.fill_uniforms(draw_uniforms(rows, self.device, row_offset=place[0],
                                                        total_rows=place[1]))
                ran = width not in self.steps
                if ran:
                    self.steps[width], ran = self._prepare(width)
                    if self.mode == "compiled":  # the first step checked every guard; the later ones pass
                        stack.enter_context(later_calls())
                run, direct = self.steps[width]
                if not ran:
                    run()
                    direct_steps += direct
                if (t + 1) % check_every == 0 or t == max_new_tokens - 1:
                    if decoder.bad.any():
                        raise ValueError(BAD_DISTRIBUTION)
                    if decoder.done.all():
                        break
        return direct_steps

    def _prepare(self, width: int) -> tuple[tuple[Callable[[], object], bool], bool]:
        """The step runner of ``width`` and whether it is a direct compiled call; and whether preparing it ran
        this step (the compiled path's first step)."""
        decoder = self.decoder
        if self.mode == "eager":
            return (functools.partial(decoder.step, width), False), False
        if self.mode == "compiled":
            step = compiled(StaticDecoder.step, self.device.type, dynamic=False)
            direct = first_compiled_call(step, decoder)
            return (direct or functools.partial(step, decoder), direct is not None), True
        if self.compile_step and self.compile_error is None:
            try:
                return (self._captured(width, compile_step=True), False), False
            except Exception as error:  # a step inductor cannot compile or a graph cannot hold
                self.compile_error = f"{type(error).__name__}: {str(error)[:300]}"
                warnings.warn("could not capture the compiled decoding step as a CUDA graph "
                              f"({self.compile_error}); capturing the eager step", stacklevel=4)
        if self.capture_error is None:
            try:
                return (self._captured(width, compile_step=False), False), False
            except Exception as error:  # a model whose step cannot be captured still samples
                self.capture_error = f"{type(error).__name__}: {str(error)[:300]}"
                warnings.warn(f"could not capture the decoding step as a CUDA graph ({self.capture_error}); "
                              "decoding without it", stacklevel=4)
        return (functools.partial(decoder.step, width), False), False

    def _captured(self, width: int, *, compile_step: bool) -> Callable[[], object]:
        """The step at ``width`` warmed up on the capture's side stream (compiled first when
        ``compile_step``), every buffer it changed put back, then captured; returns the graph's replay."""
        buffers = self.decoder.state()
        saved = [b.clone() for b in buffers]
        try:
            with self.capture.side_stream():
                if compile_step:
                    step = compiled(_bucket_step, self.device.type, dynamic=None)
                    run = (first_compiled_call(step, self.decoder, width)
                           or functools.partial(step, self.decoder, width))
                    _restore(buffers, saved)
                else:
                    run = functools.partial(self.decoder.step, width)
                for _ in range(1 if compile_step else 2):
                    run()
                    _restore(buffers, saved)
            graph = self.capture.capture(run)
        except Exception:
            self.capture.recover()
            raise
        finally:
            _restore(buffers, saved)
        self.captures += 1
        return graph.replay


@torch.no_grad()
def decode_static(model: nn.Module, ids: Tensor, mask: Tensor, *, repeats: int, max_new_tokens: int,
                  eos_ids: Sequence[int], pad_id: int, draw: TokenDraw, mode: Mode = "eager",
                  check_every: int | None = None, clock: PhaseClock | None = None,
                  info: dict | None = None, row_offset: int = 0, total_rows: int | None = None,
                  bucket_tokens: int | None = BUCKET_TOKENS, compile_step: bool = False, capture=None
                  ) -> tuple[Tensor, Tensor | None]:
    """Completions of the left-padded prompts ``ids`` / ``mask`` [B, P], each repeated ``repeats``
    times, on the static path with a decoder built for this call alone (:class:`StaticDecoding` keeps one
    for a run); same contract as :func:`grpo_engine.sampling.decode.decode`.

    Args:
        mode: ``"eager"``, ``"compiled"`` (``torch.compile``) or ``"cuda_graph"`` (CUDA only; falls
            back to eager steps with a warning when the step cannot be captured).
        check_every: tokens between host checks of the EOS flags (default 16 on CUDA, 1 on the CPU,
            where a check costs nothing and a finished batch should stop at once).
        clock: marked "prefill" once the cache is filled, "decode" at the end (graphs captured within).
        info: when given, filled with ``path`` (the mode that ran), ``capture_error`` (why a CUDA
            graph could not be captured, or None), ``compile_error`` (why the graphs hold the eager step),
            ``graph_step``, ``captures`` and ``direct_steps`` (``"compiled"``: the steps that called the
            first step's compiled graph directly,
            :func:`~grpo_engine.sampling.compiled_step.first_compiled_call`).
        row_offset, total_rows: these rows' place among the step's rows (data parallel), as in ``decode``.
        bucket_tokens, compile_step, capture: as in :class:`StaticDecoding` (a one-call ``"cuda_graph"``
            captures the eager step by default: compiling pays over a run, not one call).

    Raises:
        ValueError: a step's logits were not a distribution (checked at the host checks).
    """
    decoding = StaticDecoding(model, rows=ids.shape[0] * repeats, prompt_tokens=ids.shape[1],
                              max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, draw=draw,
                              mode=mode, bucket_tokens=bucket_tokens, compile_step=compile_step,
                              capture=capture)
    return decoding(ids, mask, repeats=repeats, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                    draw=draw, check_every=check_every, clock=clock, info=info, row_offset=row_offset,
                    total_rows=total_rows)
