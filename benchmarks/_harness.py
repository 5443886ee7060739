"""The machinery every benchmark script shares: workers, their order, time limits, JSON reports, summaries.

A benchmark parent runs each (engine or arm, repetition or seed) in a fresh worker process: the
script itself with a hidden ``--worker`` flag, started by :func:`run_worker` under a time limit, in
the offline environment of :func:`worker_env`. The worker prints its result as one tagged JSON line
(:func:`emit`); its stderr goes to a log as it runs. :func:`schedule` gives the order (ours, trl,
ours, trl, ... or rotated per round), :func:`time_limit` cuts a worker's fixed limit to a deadline,
:func:`write_report` rewrites the report after each worker, so a crash keeps what finished.
:func:`versions` and :func:`hardware` describe the run; :func:`median`, :func:`mean` and :func:`sd`
skip missing values. The last three helpers read back what an engine's model holds (the workers'
settings records).

Importing this module puts the repository root on ``sys.path`` (the scripts import grpo_engine).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULT_TAG = "BENCHMARK_RESULT "  # a worker's result line on stdout: the tag, then one JSON object
PARTIAL_TAG = "BENCHMARK_PARTIAL "  # the result so far, printed after each measured step (emit_partial)
LAUNCHED_AT = "BENCHMARK_LAUNCHED_AT"  # the environment variable run_worker sets to the launch time
TAIL_CHARS = 3000  # of a failed worker's output, in its error


# -- workers --------------------------------------------------------------------------------------


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment for a worker: the repository on ``PYTHONPATH``, the Hugging Face
    libraries offline, no tokenizer threads, TRL's experimental-feature notice silenced, then ``extra``.

    Example:
        >>> worker_env(OMP_NUM_THREADS="1")["HF_HUB_OFFLINE"]
        '1'
    """
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
            **extra}


def emit(result: dict) -> None:
    """Prints a worker's result as the line :func:`run_worker` reads back."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def emit_partial(result: dict) -> None:
    """Prints the result so far (after a measured step): what :func:`run_worker` returns, marked
    ``"partial": true``, when the worker is killed or crashes before :func:`emit`."""
    print(PARTIAL_TAG + json.dumps(result), flush=True)


def launched_at() -> float:
    """In a worker: when the parent launched it (epoch seconds; now when not started by run_worker)."""
    return float(os.environ.get(LAUNCHED_AT, time.time()))


def run_worker(name: str, args: Sequence[str], timeout: float, env: dict[str, str] | None = None,
               log: Path | None = None, python: str | None = None) -> tuple[dict | None, str | None]:
    """Runs ``python *args`` as one worker and returns ``(result, None)`` or ``(None, error)``.

    ``python`` is the interpreter (default: this process's); another venv's, e.g. ``.venv-vllm/bin/python``
    for a vLLM arm, runs the worker with that venv's libraries.

    The result is the JSON of the worker's last stdout line that starts with ``RESULT_TAG`` (see
    :func:`emit`), whatever its exit status (a crash at interpreter shutdown keeps a finished
    measurement). A worker killed at its time limit, or failing, without that line returns both its
    last ``PARTIAL_TAG`` result (:func:`emit_partial`, marked ``"partial": True``) and the error:
    the steps it measured are kept. Its stderr goes to ``log`` as it runs, appended after a
    ``--- name`` line, then any other stdout; without a log it is kept only for the error, which
    ends with its last ``TAIL_CHARS`` characters. After ``timeout`` seconds the worker is killed.

    Example:
        >>> run_worker("demo", ["-c", "print('BENCHMARK_RESULT {\\"x\\": 1}')"], timeout=60)
        ({'x': 1}, None)
    """
    cmd = [python or sys.executable, *args]
    where = f", log: {log}" if log is not None else ""
    with (log.open("a+", errors="replace") if log is not None else tempfile.TemporaryFile("w+")) as sink:
        sink.write(f"--- {name}\n")
        sink.flush()
        start = sink.tell()
        env = {**(env if env is not None else worker_env()), LAUNCHED_AT: repr(time.time())}
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sink, text=True, timeout=timeout,
                                  env=env)
        except subprocess.TimeoutExpired as stopped:
            stdout = _text(stopped.stdout)
            _append(sink, name, stdout, "killed: timed out")
            error = f"{name}: worker timed out after {timeout:.0f} s" + (f" (log: {log})" if log else "")
            return _tagged(stdout, PARTIAL_TAG), error
        _append(sink, name, proc.stdout, f"exit {proc.returncode}")
        sink.seek(start)
        tail = sink.read()[-TAIL_CHARS:]
    result = _tagged(proc.stdout, RESULT_TAG)
    if result is not None:
        return result, None
    error = f"{name}: worker failed (exit {proc.returncode}{where}):\n{tail}"
    return _tagged(proc.stdout, PARTIAL_TAG), error


def _tagged(stdout: str, tag: str) -> dict | None:
    """The JSON of the last line of ``stdout`` that starts with ``tag``; a partial one is marked so."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(tag):
            try:
                result = json.loads(line[len(tag):])
            except json.JSONDecodeError:  # a line cut by the kill
                continue
            return {**result, "partial": True} if tag == PARTIAL_TAG else result
    return None


def _append(sink, name: str, stdout: str, end: str) -> None:
    other = [line for line in stdout.splitlines() if not line.startswith((RESULT_TAG, PARTIAL_TAG))]
    sink.seek(0, os.SEEK_END)
    if other:
        sink.write(f"--- {name}: stdout\n" + "\n".join(other) + "\n")
    sink.write(f"--- {name}: {end}\n")
    sink.flush()


def _text(output: bytes | str | None) -> str:
    """A TimeoutExpired's output: bytes even under text=True."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def schedule(arms: Sequence[str], rounds: Iterable[int], *, rotate: bool) -> list[tuple[int, str]]:
    """The workers' order, ``(round, arm)``: every arm once per round (a round is a repetition or a seed).

    Without ``rotate``: A B, A B, ...; with it, round k starts at arm k mod len(arms) (A B, B A, ...;
    A B C, B C A, ...), so that a slow drift of a shared machine does not always hit the same arm.

    Example:
        >>> schedule(["ours", "trl"], range(2), rotate=False)
        [(0, 'ours'), (0, 'trl'), (1, 'ours'), (1, 'trl')]
        >>> schedule(["ours", "trl"], [2, 3], rotate=True)
        [(2, 'ours'), (2, 'trl'), (3, 'trl'), (3, 'ours')]
    """
    order = []
    for k in rounds:
        shift = k % len(arms) if rotate else 0
        order += [(k, arm) for arm in [*arms[shift:], *arms[:shift]]]
    return order


def time_limit(fixed_s: float, end: float | None, minimum_s: float = 10.0) -> float | None:
    """A worker's time limit: its fixed limit, cut to what is left before ``end`` (epoch seconds; None:
    no end); None when less than ``minimum_s`` is left, so that the caller skips the worker."""
    if end is None:
        return fixed_s
    left = min(fixed_s, end - time.time())
    return left if left >= minimum_s else None


def say(tag: str, text: str) -> None:
    """A progress line on stderr, e.g. ``[perf] micro: ours repetition 1/2``."""
    print(f"[{tag}] {text}", file=sys.stderr, flush=True)


# -- reports --------------------------------------------------------------------------------------


def write_report(path: Path, report: Any) -> None:
    """Writes ``report`` as indented JSON, replacing ``path`` at once (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


def versions() -> dict[str, str | None]:
    """Python's version and those of the libraries the benchmarks compare (None: not installed)."""
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def hardware(device: str) -> str:
    """The GPU's name on ``"cuda"``, else the CPU model and its logical cores."""
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} (1 GPU)"
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} logical cores"


def git_commit() -> str | None:
    """The checkout's HEAD commit, None outside git."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None; None when there are none."""
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def sd(values: Iterable[float | None]) -> float | None:
    """The sample standard deviation of the values that are not None; None under two values.

    Example:
        >>> mean([1.0, None, 3.0]), sd([1.0, None, 3.0]), sd([1.0])
        (2.0, 1.4142135623730951, None)
    """
    kept = [v for v in values if v is not None]
    return statistics.stdev(kept) if len(kept) > 1 else None


# -- what a worker reads back from its engine's model ----------------------------------------------


def lora_settings(peft_config) -> dict | None:
    """A peft ``LoraConfig`` as a comparable record (None: no adapter)."""
    if peft_config is None:
        return None
    targets = peft_config.target_modules  # peft resolves "all-linear" to module names: keep their kinds
    targets = (sorted({t.rsplit(".", 1)[-1] for t in targets}) if isinstance(targets, (set, list, tuple))
               else targets)
    return {"r": peft_config.r, "alpha": float(peft_config.lora_alpha), "dropout": peft_config.lora_dropout,
            "targets": targets}


def checkpointing(model) -> bool:
    """Whether the model recomputes activations in its backward pass."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5.x, 4.x
        with contextlib.suppress(AttributeError):
            return bool(getattr(model, name))
    return False


def advantage_text(std_scope: str, eps: float) -> str:
    """An advantage's normalisation in words, the same for both engines' settings records.

    Example:
        >>> advantage_text("group", 1e-4)
        'z-score, group std + 0.0001'
    """
    return {"group": f"z-score, group std + {eps:g}", "batch": f"z-score, batch std + {eps:g}",
            "none": "group mean only"}[std_scope]


def weights_dtype(model) -> str:
    """The dtype of the frozen weights (of every weight when all train), e.g. ``"float32"``."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return str((frozen or list(model.parameters()))[0].dtype).replace("torch.", "")
