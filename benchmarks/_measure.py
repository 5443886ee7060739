"""Measuring a step without adding synchronisation to it, and the figures derived from the times.

- :class:`StageClock` sums the time spent inside wrapped calls, by stage: CUDA events on a GPU (a
  recorded event does not wait for the GPU), the wall clock on the CPU. :meth:`StageClock.seconds`
  synchronises once, after the step. :class:`Wrapped` puts a timed call in place of an object's
  method (or of its own call) without touching the object.
- :class:`PhaseMemory`: the peak memory of each phase of a step (sampling, training, optimizer): on a
  GPU the caching allocator's peak allocated and reserved bytes (host-side statistics: reading and
  resetting them adds no synchronisation), on the CPU the resident-set high-water mark.
- :func:`decode_roofline` and :func:`training_mfu`: what a decode step must read from memory, and
  the FLOPs a training pass must compute, against a device's ceilings: :func:`ceilings` gives the
  measured ones (``benchmarks/gpu/preflight.py`` times an 8192^3 bfloat16 matrix product and a
  device-to-device copy on the machine itself) beside the card's data-sheet peaks (:data:`SPEC`).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["StageClock", "Wrapped", "PhaseMemory", "decode_roofline", "training_mfu", "ceilings", "SPEC",
           "HBM_BYTES_PER_S", "BF16_FLOPS", "status_kib"]

# the H200's ceilings as reported for the lent machines (KINDS.md of the device tool), used when no
# preflight measured this machine's own:
HBM_BYTES_PER_S = 4.3e12  # a device-to-device copy, bytes read + written per second
BF16_FLOPS = 790e12  # an 8192^3 bfloat16 matrix product
# data-sheet peaks: dense bfloat16 tensor-core FLOP/s and HBM bytes/s (SXM parts; the first match wins)
SPEC = {"H100 PCIe": (756e12, 2.0e12), "H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12),
        "A100": (312e12, 2.0e12)}
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits per weight, block scales, double quantisation
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def ceilings(device_name: str | None, preflight: Path | None = None) -> dict:
    """The ceilings a run's figures are judged against: the measured matrix-product rate and copy
    bandwidth from ``preflight`` (its JSON), else the H200 constants above, and the data-sheet peaks of
    the card ``device_name`` names (None for an unknown card, and on the CPU).

    Example:
        >>> c = ceilings("NVIDIA H200 (1 GPU)")
        >>> c["spec_bf16_flops"], c["matmul_flops"], c["source"]
        (989000000000000.0, 790000000000000.0, 'constants')
    """
    measured = {}
    if preflight is not None and preflight.exists():
        found = json.loads(preflight.read_text())
        if found.get("matmul_tflops") and found.get("copy_gb_per_s"):
            measured = {"matmul_flops": found["matmul_tflops"] * 1e12,
                        "copy_bytes_per_s": found["copy_gb_per_s"] * 1e9, "source": "preflight"}
    out = measured or {"matmul_flops": BF16_FLOPS, "copy_bytes_per_s": HBM_BYTES_PER_S, "source": "constants"}
    spec = next((v for k, v in SPEC.items() if device_name and k in device_name), (None, None))
    return {**out, "spec_bf16_flops": spec[0], "spec_hbm_bytes_per_s": spec[1]}


class StageClock:
    """Time inside wrapped calls, summed per stage (see the module docstring).

    Example:
        >>> clock = StageClock("cpu")
        >>> add = clock.wrap("add", lambda a, b: a + b)
        >>> add(1, 2), sorted(clock.seconds())
        (3, ['add'])
    """

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self._spans: list[tuple[str, object, object]] = []

    def _now(self):
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, name: str) -> tuple[str, object]:
        return name, self._now()

    def stop(self, token: tuple[str, object]) -> None:
        name, start = token
        self._spans.append((name, start, self._now()))

    def wrap(self, name: str, fn: Callable, *, when: Callable[[], bool] = lambda: True,
             after: Callable | None = None) -> Callable:
        """``fn`` timed under ``name`` (only calls for which ``when()`` holds); ``after(result)`` runs
        outside. The wrapper keeps ``fn``'s attributes (torch's scheduler marks ``optimizer.step``)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not when():
                return fn(*args, **kwargs)
            token = self.start(name)
            out = fn(*args, **kwargs)
            self.stop(token)
            if after is not None:
                after(out)
            return out
        return wrapper

    def seconds(self) -> dict[str, float]:
        """Seconds per stage since the last call; synchronises with the GPU once."""
        out: dict[str, float] = {}
        if self.cuda and self._spans:
            self._spans[-1][2].synchronize()
        for name, start, end in self._spans:
            out[name] = out.get(name, 0.0) + (start.elapsed_time(end) / 1000 if self.cuda else end - start)
        self._spans.clear()
        return out


class Wrapped:
    """``inner`` with its call and some methods replaced (e.g. by :meth:`StageClock.wrap`'s timed ones);
    every other attribute is ``inner``'s. For objects whose methods cannot be replaced in place (a frozen
    dataclass) or whose call is the thing to time (``__call__`` is looked up on the type).

    Example:
        >>> w = Wrapped([3, 1], call=lambda: "called", count=lambda x: 99)
        >>> w(), w.count(3), w.index(1)
        ('called', 99, 1)
    """

    def __init__(self, inner, *, call: Callable | None = None, **methods: Callable) -> None:
        self.inner, self.call = inner, call
        self.__dict__.update(methods)

    def __call__(self, *args, **kwargs):
        return (self.call or self.inner)(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def status_kib(key: str) -> int | None:
    """A field of ``/proc/self/status`` in KiB (``VmHWM``, ``VmRSS``); None where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class PhaseMemory:
    """Peak memory per phase, across every step (see the module docstring).

    Example:
        >>> phases = PhaseMemory("cpu")
        >>> phases.enter("sampling"); phases.enter("training")
        >>> sorted(phases.finish())
        ['sampling', 'training']
    """

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.current: str | None = None
        self.peaks: dict[str, dict[str, float]] = {}

    def _read_and_reset(self) -> dict[str, float]:
        mib = 2**20
        if self.cuda:
            import torch

            out = {"allocated_mib": torch.cuda.max_memory_allocated() / mib,
                   "reserved_mib": torch.cuda.max_memory_reserved() / mib}
            torch.cuda.reset_peak_memory_stats()
            return out
        # RSS high-water mark
        out = {"allocated_mib": (status_kib("VmHWM") or 0) / 1024, "reserved_mib": None}
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        return out

    def enter(self, phase: str) -> None:
        """Closes the current phase (keeping its peak) and starts ``phase``."""
        reading = self._read_and_reset()
        if self.current is not None:
            best = self.peaks.setdefault(self.current, {"allocated_mib": 0.0, "reserved_mib": None})
            for key, value in reading.items():
                if value is not None and (best[key] is None or value > best[key]):
                    best[key] = value
        self.current = phase

    def snapshot(self) -> dict[str, dict[str, float]]:
        """The peaks so far, the current phase's included; the current phase goes on."""
        current = self.current
        if current is not None:
            self.enter(current)
        return {k: dict(v) for k, v in self.peaks.items() if k != "done"}

    def finish(self) -> dict[str, dict[str, float]]:
        self.enter("done")
        return {k: v for k, v in self.peaks.items() if k != "done"}


def decode_roofline(*, matmul_params: int, weight_bytes: float, lora_params: int, rows: int,
                    prompt_tokens: int, completion_tokens: int, kv_bytes_per_token: int,
                    decode_s: float | None, hbm_bytes_per_s: float = HBM_BYTES_PER_S) -> dict:
    """What each decode step must read (every weight once, the adapters, and each row's KV cache at
    its mean context P + C/2) and that traffic over the measured decode time, as a fraction of HBM.

    Example:
        >>> r = decode_roofline(matmul_params=10**9, weight_bytes=2, lora_params=0, rows=1, prompt_tokens=0,
        ...                     completion_tokens=1000, kv_bytes_per_token=0, decode_s=1.0,
        ...                     hbm_bytes_per_s=4e12)
        >>> r["bytes_per_step"], r["fraction"]
        (2000000000.0, 0.5)
    """
    kv = rows * (prompt_tokens + completion_tokens / 2) * kv_bytes_per_token
    per_step = matmul_params * weight_bytes + lora_params * 4 + kv
    achieved = completion_tokens * per_step / decode_s if decode_s else None
    return {"bytes_per_step": per_step, "weight_bytes_per_step": matmul_params * weight_bytes,
            "kv_bytes_per_step": kv, "achieved_bytes_per_s": achieved,
            "fraction": achieved / hbm_bytes_per_s if achieved else None}


def training_mfu(*, matmul_params: int, layers: int, q_dim: int, trained_tokens: int, sequence_tokens: int,
                 full: bool, checkpointing: bool, train_s: float | None,
                 peak_flops: float = BF16_FLOPS) -> dict:
    """FLOPs of one training pass over ``trained_tokens`` and their rate against ``peak_flops``.

    Per token: 6 N for full fine-tuning (forward 2 N, backward 4 N), 4 N under LoRA (no gradient for
    the frozen weights), + 2 N when gradient checkpointing recomputes the forward; plus causal
    attention, 2 x layers x q_dim x L per forward (L = ``sequence_tokens``), three times (its
    backward computes the gradients of queries, keys and values in either case), + 1 recomputed.

    Example:
        >>> training_mfu(matmul_params=10**9, layers=1, q_dim=0, trained_tokens=1000, sequence_tokens=1,
        ...              full=True, checkpointing=False, train_s=1.0, peak_flops=1e13)["mfu"]
        0.6
    """
    recompute = 1 if checkpointing else 0
    passes = (3 if full else 2) + recompute  # forward-equivalents of the weights: 2 N FLOPs each
    per_token = passes * 2 * matmul_params + (3 + recompute) * 2 * layers * q_dim * sequence_tokens
    flops = per_token * trained_tokens
    return {"flops_per_step": flops, "flops_per_token": per_token,
            "achieved_flops": flops / train_s if train_s else None,
            "mfu": flops / train_s / peak_flops if train_s else None}
