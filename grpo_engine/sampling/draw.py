"""What both decoding paths share (the dynamic loop, :mod:`grpo_engine.sampling.decode`, and the static
one, :mod:`grpo_engine.sampling.static`): the token draw, its random stream, and the phase clock.

- :class:`TokenDraw`: temperature, then top-k / top-p, then :func:`categorical`, an exact inverse-CDF
  draw: one uniform picks a block of 256 token ids by its mass, a second the id inside it, so a token's
  probability keeps its float32 precision however small and an id of probability 0 is never drawn. Two
  uniforms per row instead of ``torch.multinomial``'s V exponentials (1 ms against 33 ms per 32 x 49,152
  draw on 2 CPU cores), fixed shapes, no host synchronisation: it can run inside a CUDA graph.
- Each step draws uniforms for every row of the whole step, running or not, and keeps its own rows
  (``row_offset``, ``total_rows``; :func:`draw_uniforms`): the dynamic loop and the static path consume
  the random stream identically, and K data-parallel ranks draw the tokens one process would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TokenDraw", "PhaseClock", "categorical", "sample_categorical", "inverse_cdf", "draw_uniforms",
           "seeded_rng", "BAD_DISTRIBUTION", "BLOCK"]

BLOCK = 256  # token ids per block of the two-level draw
BAD_DISTRIBUTION = ("sampling got a row of probabilities that sums to zero or holds NaN/inf: "
                    "the model's logits hold NaN or inf, or top-k / top-p removed every token; "
                    "check the model's outputs (e.g. an fp16 overflow) and the sampling settings")


def inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Per row of ``weights`` [n, K] (non-negative), the first index whose running sum reaches
    ``u`` [n] (in (0, 1]) times the row's total; an entry of weight 0 is never returned.

    Example:
        >>> inverse_cdf(torch.tensor([[0.0, 1.0, 0.0, 3.0]] * 3), torch.tensor([0.1, 0.25, 0.3])).tolist()
        [1, 1, 3]
    """
    cdf = weights.double().cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]  # in (0, total]: the first cdf >= target has weight > 0
    return torch.searchsorted(cdf, target).squeeze(-1)


def draw_uniforms(rows: int, device: torch.device | str, *, row_offset: int = 0, total_rows: int | None = None
                  ) -> Tensor:
    """[rows, 2] float64 uniforms in (0, 1]: the random input of one :func:`categorical` draw per row.

    With ``total_rows``, uniforms are drawn for all ``total_rows`` rows and rows ``row_offset ..
    row_offset + rows - 1`` are returned: a rank's share of a draw for the whole step.

    Example:
        >>> _ = torch.manual_seed(0); whole = draw_uniforms(4, "cpu")
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(draw_uniforms(2, "cpu", row_offset=2, total_rows=4), whole[2:])
        True
    """
    total = rows if total_rows is None else total_rows
    if not 0 <= row_offset <= total - rows:
        raise ValueError(f"draw_uniforms: rows {row_offset}..{row_offset + rows - 1} are not within the "
                         f"{total} rows of the draw")
    return 1.0 - torch.rand(total, 2, dtype=torch.float64, device=device)[row_offset:row_offset + rows]


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seeds the CPU RNG (and ``device``'s, when a GPU) for the block and restores both afterwards.

    Example:
        >>> with seeded_rng(3, torch.device("cpu")):
        ...     a = torch.rand(1)
        >>> with seeded_rng(3, torch.device("cpu")):
        ...     torch.equal(a, torch.rand(1))
        True
    """
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def categorical(probs: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """One id [n] per row of ``probs`` [n, V] (non-negative; rows need not sum to 1) from the
    uniforms ``u`` [n, 2], and whether each row was a distribution [n] (a row that sums to zero or
    holds NaN / inf gets an arbitrary id and False). No host synchronisation.

    Example:
        >>> categorical(torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]]), torch.full((2, 2), 0.5))
        (tensor([1, 0]), tensor([True, True]))
    """
    n, vocab = probs.shape
    pad = (-vocab) % BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(n, -1, BLOCK)  # padding has weight 0
    mass = blocks.sum(-1)  # [n, V / BLOCK]
    total = mass.sum(-1)
    ok = torch.isfinite(total) & (total > 0)
    # clamped: a bad row must not index outside
    block = inverse_cdf(mass, u[:, 0]).clamp(max=mass.shape[1] - 1)
    inner = blocks[torch.arange(n, device=probs.device), block]  # [n, BLOCK]
    return (block * BLOCK + inverse_cdf(inner, u[:, 1])).clamp(max=vocab - 1), ok


def sample_categorical(probs: Tensor) -> Tensor:
    """One id [n] drawn from each row of ``probs`` [n, V] (non-negative; rows need not sum to 1).

    Raises:
        ValueError: a row sums to zero, or holds NaN or infinity.
    """
    ids, ok = categorical(probs, draw_uniforms(probs.shape[0], probs.device))
    if not ok.all():
        raise ValueError(BAD_DISTRIBUTION)
    return ids


class PhaseClock:
    """Marks points in a run of GPU work without synchronising it: CUDA events on a GPU, the wall
    clock on the CPU. :meth:`seconds` waits for the last mark, then gives the time between
    consecutive marks, each named by the later one.

    Example:
        >>> clock = PhaseClock(torch.device("cpu"))
        >>> clock.mark("start"); clock.mark("prefill"); clock.mark("decode")
        >>> sorted(clock.seconds())
        ['decode', 'prefill']
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            import time

            self.marks.append((name, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        if not self.marks:
            return {}
        if self.cuda:
            self.marks[-1][1].synchronize()
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = out.get(name, 0.0) + (a.elapsed_time(b) / 1000 if self.cuda else b - a)
        return out


class TokenDraw:
    """Chooses one token per row from a step's logits: temperature, then top-k / top-p, then an
    exact categorical draw (``greedy``: the argmax). The log-prob it reports is the drawn token's
    under the temperature-scaled distribution before top-k / top-p, the quantity the trainer computes.

    Args:
        temperature: logits are divided by it.
        top_k, top_p: truncation (0 and 1.0 are off); transformers' warpers, applied in that order.
        greedy: take the argmax instead of drawing (uniforms are then ignored).
        logprobs: also report the drawn tokens' log-probs (one log-softmax per step).

    Example:
        >>> token, logprob, ok = TokenDraw(greedy=True)(torch.tensor([[0.0, 2.0, 1.0]]), None)
        >>> token.tolist(), ok.tolist()
        ([1], [True])
    """

    def __init__(self, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                 logprobs: bool = True) -> None:
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.temperature, self.greedy, self.logprobs = temperature, greedy, logprobs
        self.warpers = ([TopKLogitsWarper(top_k)] if top_k > 0 else []) + \
                       ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])

    @property
    def needs_uniforms(self) -> bool:
        return not self.greedy

    def __call__(self, logits: Tensor, u: Tensor | None, *, temperature: Tensor | None = None
                 ) -> tuple[Tensor, Tensor | None, Tensor]:
        """(token ids [n], their log-probs [n] or None, whether each row was a distribution [n])
        from ``logits`` [n, V] and uniforms ``u`` [n, 2]. ``temperature``: a float32 tensor [] to divide by
        instead of the draw's own (a buffer a captured step reads, refreshed at each call; on the CPU the
        quotient is the same bit for bit, on CUDA a Python divisor is applied as its reciprocal, so the two
        may differ by one float32 rounding)."""
        scores = logits.float() / (self.temperature if temperature is None else temperature)
        logprobs = torch.log_softmax(scores, dim=-1) if self.logprobs else None
        if self.greedy:
            token, ok = scores.argmax(-1), torch.isfinite(scores).all(-1)
        else:
            for warper in self.warpers:  # the warpers read only the scores
                scores = warper(None, scores)
            probs = (logprobs.exp() if logprobs is not None and not self.warpers
                     else torch.softmax(scores, dim=-1))
            token, ok = categorical(probs, u)
        if logprobs is None:
            return token, None, ok
        return token, logprobs.gather(-1, token[:, None]).squeeze(-1), ok
