"""The decoding step through ``torch.compile``, and its compiled graph called directly.

- :func:`compiled`: a step function through ``torch.compile`` with inductor, once per (function, device,
  dynamic) for the process; on the CPU with inductor's C++ wrapper (a token step is many small kernels
  there, called from C++ rather than Python).
- :func:`first_compiled_call`: runs the step through ``torch.compile`` once, every guard checked, and
  returns the graph that ran bound to the arguments dynamo gave it, so later steps call it directly
  (about 0.2 ms a token less on the CPU, and the call a CUDA graph captures on a GPU).
- ``dynamic=None`` (the persistent GPU runner): the step is specialised on its first attended width and
  compiled once more, with the width symbolic, when a second width comes (dynamo's automatic dynamic
  shapes), so every bucket of a run shares two compiles. ``dynamic=False``: every shape static (the
  per-call CPU path).
Imports nothing of the package: the static runner passes the function in.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

__all__ = ["compiled", "first_compiled_call", "later_calls", "recording_backend"]

_COMPILED: dict[tuple[Callable, str, bool | None], Callable] = {}
# (graph, arguments, outputs) of each run of a compiled graph inside first_compiled_call; None elsewhere, so
# that no run outside it keeps its tensors (a KV cache) alive
_GRAPH_RUNS: list[list[tuple[Callable, tuple, object]] | None] = [None]


def recording_backend(options: dict | None):
    """Inductor (``compile_fx``, as ``torch.compile``'s default backend) with each compiled graph wrapped
    to record its runs while :func:`first_compiled_call` runs: the arguments dynamo passes it are the
    step's tensors (and symbolic sizes), read from the decoder and the model. None where this torch has no
    ``compile_fx``."""
    try:
        from torch._inductor.compile_fx import compile_fx
    except ImportError:
        return None

    def backend(graph_module, example_inputs):
        graph = compile_fx(graph_module, example_inputs, config_patches=options)

        def run(*args):
            out = graph(*args)
            if _GRAPH_RUNS[0] is not None:
                _GRAPH_RUNS[0].append((graph, args, out))
            return out
        return run
    return backend


def compiled(function: Callable, device_type: str, *, dynamic: bool | None = False) -> Callable:
    """``function`` through ``torch.compile`` (one object per function, device type and ``dynamic``); on
    the CPU with inductor's C++ wrapper. Each function keeps its own dynamo cache (its own code object)."""
    key = (function, device_type, dynamic)
    if key not in _COMPILED:
        options = {"cpp_wrapper": True} if device_type == "cpu" else None
        backend = recording_backend(options)
        _COMPILED[key] = (torch.compile(function, dynamic=dynamic, backend=backend) if backend is not None
                          else torch.compile(function, dynamic=dynamic, options=options))
    return _COMPILED[key]


def first_compiled_call(step: Callable, *args) -> Callable[[], object] | None:
    """Runs ``step(*args)`` (a :func:`compiled` function) with every guard checked, and returns the graph
    that ran bound to the arguments dynamo gave it, for the later calls with the same arguments; or None
    (the later calls go through ``torch.compile``) unless the call ran as one graph that returned nothing.

    Calling the graph directly skips dynamo's guards and the code around the graph. It is exact when every
    later call reads and writes the same tensors, in place, with the same shapes, under the same modules
    (the step changes no Python state), and a graph that returns nothing leaves dynamo nothing to write
    back."""
    runs = _GRAPH_RUNS[0] = []
    try:
        step(*args)
    finally:
        _GRAPH_RUNS[0] = None
    if len(runs) != 1 or runs[0][2] not in (None, (), []):
        return None
    graph, graph_args, _ = runs[0]
    return functools.partial(graph, *graph_args)


def later_calls() -> contextlib.AbstractContextManager:
    """torch.compile skipping the guards that do not tell compiled graphs apart (torch 2.7+), or nothing."""
    try:
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    except (AttributeError, TypeError):
        return contextlib.nullcontext()
