"""Checkpoints: durable saves and the checkpoint format for exact resume.

- A save writes everything to a hidden temporary sibling folder, fsyncs every file and the folder,
  then swaps it with the target in one atomic exchange (``renameat2(RENAME_EXCHANGE)`` on Linux; where
  that is missing, the old folder is renamed aside first and put back at the next start if the new one
  never arrived) and fsyncs the parent: a complete latest checkpoint exists at every moment.
- :func:`clean_leftovers` (run before training starts) removes temporary folders and restores a
  set-aside one whose replacement is missing.
- A trainer checkpoint is a model folder (the adapter, or every weight) with ``trainer_state.pt`` (the
  trainer's ``state_dict()``: counters, scheduler, RNG states of python, numpy, torch CPU and CUDA,
  the prompt source's and every callback's state; and the optimizer's) and ``trainer_state.json``
  (the step and what the run is made of, for the resume check); under FSDP2 the optimizer state is
  an ``optimizer/`` folder of ``torch.distributed.checkpoint`` shards (one file per rank), resharded
  on load for any number of ranks.
- :func:`read_checkpoint` refuses a run that changed a setting or component, naming each field (the
  safe ones may change when named in ``Resume.allow_changes``). It reads nothing of the trainer: the
  trainer hands in its description and loads the state itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["save_pretrained_atomic", "write_text_atomic", "clean_leftovers", "latest_checkpoint",
           "prune_checkpoints", "Resume", "ResumeError", "SAFE_CHANGES", "resolve", "read_checkpoint",
           "summary", "run_description", "load_weights", "gather_weights", "staging_folder",
           "save_sharded_optimizer", "load_sharded_optimizer", "load_whole_optimizer_sharded", "rng_states",
           "set_rng_states", "truncate_metrics", "used_output_dir"]

STATE_FILE, SUMMARY_FILE, OPTIMIZER_DIR = "trainer_state.pt", "trainer_state.json", "optimizer"
# settings that may change on resume (when named): limits, bookkeeping, and what changes only speed or
# summation order
SAFE_CHANGES = frozenset({
    "config.max_steps", "config.max_train_seconds", "config.save_every_steps", "config.keep_last_checkpoints",
    "config.log_every_steps", "config.progress_bar", "config.report_to", "config.max_nonfinite_steps",
    "config.output_dir", "config.reward_timeout_s", "config.on_reward_error", "memory.decoding",
    "memory.micro_batch_size", "memory.logprob_chunk_size", "memory.logprob_vocab_tile", "memory.sharding",
    "memory.compile_training", "memory.compile_decoding", "memory.pack_weights_for_sampling",
    "memory.compiled_products_for_sampling", "config.place_model",
})


class ResumeError(ValueError):
    """A checkpoint that cannot continue this trainer's run (each reason named)."""


@dataclass(frozen=True)
class Resume:
    """Where to resume from, and which safe settings (``SAFE_CHANGES``) may differ from the saved run.

    Example:
        >>> Resume("latest", allow_changes={"config.max_steps"}).path
        'latest'
    """

    path: str | Path = "latest"
    allow_changes: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow_changes", frozenset(self.allow_changes))
        unsafe = sorted(self.allow_changes - SAFE_CHANGES)
        if unsafe:
            raise ResumeError(f"allow_changes {unsafe} cannot change on resume (they change the run's math); "
                             f"the safe ones are {sorted(SAFE_CHANGES)}")


# -- durable folders ---------------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """fsync every file below ``folder``, then every folder, deepest first."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync_path(Path(root) / name)
        _fsync_path(Path(root))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two existing paths (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where
    the system or the file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _replace_folder(tmp: Path, path: Path) -> None:
    """Puts the complete folder ``tmp`` at ``path``, never leaving ``path`` without a complete folder
    (the exchange), or only for the two renames of the fallback, which :func:`clean_leftovers` repairs."""
    if not path.exists():
        os.replace(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # the old folder, now at the temporary name
    else:
        aside = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
        os.replace(path, aside)
        os.replace(tmp, path)
        shutil.rmtree(aside)
    _fsync_path(path.parent)


def staging_folder(path: str | Path) -> Path:
    """A fresh hidden temporary sibling of ``path`` to write a save into (:func:`clean_leftovers` removes
    it if the save never completes)."""
    path = Path(path)
    return path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"


def save_pretrained_atomic(model: nn.Module, tokenizer: Any, path: str | Path,
                           extra_files: dict[str, str] | None = None, objects: dict[str, Any] | None = None,
                           state_dict: dict[str, torch.Tensor] | None = None,
                           tmp: Path | None = None) -> Path:
    """Saves ``model`` and ``tokenizer`` in the transformers / peft layout at ``path``, durably.

    Args:
        model: a transformers model or a peft model (then only the adapter is written).
        tokenizer: saved beside it, so the folder loads on its own (None: skipped).
        path: the target folder; an existing one is replaced only by a complete new one.
        extra_files: file name -> text, written beside the weights (e.g. the run's YAML config).
        objects: file name -> object written with ``torch.save`` (e.g. the trainer state).
        state_dict: the model's whole weights when its modules hold shards (FSDP2), else None.
        tmp: the :func:`staging_folder` to complete, when other files were written into it first (the
            ranks' optimizer shards); by default a new one.

    Returns:
        The target path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp if tmp is not None else staging_folder(path)
    try:
        model.save_pretrained(tmp, **({"state_dict": state_dict} if state_dict is not None else {}))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        for name, obj in (objects or {}).items():
            torch.save(obj, tmp / name)
        _fsync_tree(tmp)
        _replace_folder(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Writes ``text`` to ``path`` through a temporary sibling, fsynced and renamed over it: a reader
    sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def clean_leftovers(folder: str | Path) -> list[str]:
    """Removes the temporary folders an interrupted save left in ``folder`` and puts back a set-aside
    folder whose replacement never arrived; returns what it did, one line each."""
    folder, done = Path(folder), []
    if not folder.is_dir():
        return done
    for leftover in sorted(folder.glob(".old-*")):
        name = re.sub(r"^\.old-(.*)-[0-9a-f]{8}$", r"\1", leftover.name)
        if not (folder / name).exists():
            os.replace(leftover, folder / name)
            done.append(f"restored {name} (a save was interrupted between its two renames)")
        else:
            shutil.rmtree(leftover, ignore_errors=True)
            done.append(f"removed {leftover.name}")
    for leftover in sorted(folder.glob(".tmp-*")):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
        done.append(f"removed {leftover.name} (an interrupted save)")
    return done


def _checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete trainer checkpoints in ``output_dir`` (final included)."""
    found = []
    for folder in [*output_dir.glob("checkpoint-*"), output_dir / "final"]:
        summary = folder / SUMMARY_FILE
        if summary.is_file() and (folder / STATE_FILE).is_file():
            found.append((int(json.loads(summary.read_text())["step"]), folder))
    return sorted(found, key=lambda pair: (pair[0], pair[1].name == "final"))  # at equal steps, final last


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete trainer checkpoint of the highest step in ``output_dir``, or None."""
    found = _checkpoints(Path(output_dir))
    return found[-1][1] if found else None


def prune_checkpoints(output_dir: str | Path, keep_last: int | None) -> list[Path]:
    """Deletes all but the newest ``keep_last`` ``checkpoint-N`` folders (never ``final``); returns them."""
    if keep_last is None:
        return []
    olds = [folder for _, folder in _checkpoints(Path(output_dir))
            if folder.name != "final"][:-keep_last or None]
    for folder in olds:
        shutil.rmtree(folder, ignore_errors=True)
    return olds


def used_output_dir(output_dir: str | Path) -> str | None:
    """Why a new run cannot start in ``output_dir`` (it already holds a run's ``metrics.jsonl``), or None."""
    metrics = Path(output_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        return (f"output_dir={str(output_dir)!r} already holds a run (metrics.jsonl); continue it with "
                "--resume, that is GRPOTrainer(..., resume_from='latest') (CLI: --resume), or choose another "
                "config.output_dir, or move the old run away first: a new run would mix its metrics with it "
                "and replace its saved model")
    return None


def truncate_metrics(path: Path, step: int) -> None:
    """Drops the lines of ``metrics.jsonl`` after ``step`` (logged after the checkpoint by an interrupted
    run)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return
    write_text_atomic(path, "".join(kept))


# -- the run's state ----------------------------------------------------------------------------------


def rng_states() -> dict[str, Any]:
    """The states of python's, numpy's and torch's (CPU, CUDA) global random generators."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    states["cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    with contextlib.suppress(ImportError):
        import numpy

        states["numpy"] = numpy.random.get_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restores :func:`rng_states`'s output."""
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if states.get("numpy") is not None:
        import numpy

        numpy.random.set_state(states["numpy"])


def _describe(component: Any) -> str:
    """A stable description of a component: its repr, or its type where the repr holds an address."""
    text = repr(component)
    return type(component).__qualname__ if " at 0x" in text else text


def run_description(config: Any, memory: Any, components: dict[str, Any], sampler: Any,
                    callbacks: Sequence[Any]) -> dict[str, Any]:
    """What a run is made of, compared on resume: every setting of ``config`` and ``memory`` (pydantic
    models), each of ``components`` (name -> object), the sampler's type and the callbacks' types."""
    settings = {f"config.{k}": v for k, v in config.model_dump(mode="json").items()}
    settings.update({f"memory.{k}": v for k, v in memory.model_dump(mode="json").items()})
    described = {name: _describe(component) for name, component in components.items()}
    described["sampler"] = type(sampler).__qualname__
    described["callbacks"] = [type(c).__qualname__ for c in callbacks]
    defaults = {f"config.{k}": v for k, v in type(config)().model_dump(mode="json").items()}
    defaults.update({f"memory.{k}": v for k, v in type(memory)().model_dump(mode="json").items()})
    return {"settings": settings, "components": described, "defaults": defaults}


def summary(counters: dict[str, Any], description: dict[str, Any]) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint: where the run stands and what it is made of."""
    where = {key: counters[key] for key in ("step", "train_seconds", "temperature", "skipped_steps")}
    return {"format": 2, **where, **{k: v for k, v in description.items() if k != "defaults"}}


def _differences(saved: dict[str, Any], now: dict[str, Any], allowed: Iterable[str]) -> list[str]:
    problems, allowed = [], set(allowed)
    for key in sorted(set(saved["settings"]) | set(now["settings"])):
        old, new = saved["settings"].get(key), now["settings"].get(key)
        # a setting newer than the checkpoint, at its default, is what that run did
        added = key not in saved["settings"] and new == now.get("defaults", {}).get(key, ...)
        if old == new or key in allowed or added:
            continue
        if key in SAFE_CHANGES:
            problems.append(f"{key} was {old!r}, now {new!r}: allow it with Resume(path, allow_changes="
                            f"{{'{key}'}}) (CLI: --allow-change {key})")
        else:
            problems.append(f"{key} was {old!r}, now {new!r}: it changes the run's math; resume with the "
                            "saved value, or start a new run in another output_dir")
    for key in sorted(set(saved["components"]) | set(now["components"])):
        old, new = saved["components"].get(key), now["components"].get(key)
        if old != new:
            problems.append(f"{key} was {old}, now {new}: build the trainer with the saved run's {key}")
    return problems


def resolve(output_dir: str | Path, resume: Resume, world: Any) -> Path:
    """The checkpoint folder ``resume`` names, picked by rank 0 of ``world`` (after tidying
    ``output_dir``) for every rank.

    Raises:
        FileNotFoundError: no checkpoint there.
    """
    output_dir, folder = Path(output_dir), None
    if world.is_main:
        clean_leftovers(output_dir)
        folder = latest_checkpoint(output_dir) if str(resume.path) == "latest" else Path(resume.path)
    folder = world.broadcast(folder)
    if folder is None or not (folder / STATE_FILE).is_file():
        where = f"in {output_dir}" if folder is None else f"at {folder}"
        raise FileNotFoundError(f"no trainer checkpoint {where} to resume from (a checkpoint folder holds "
                                f"{STATE_FILE}); start without resume_from, or point it at a checkpoint-N "
                                "folder")
    return folder


def read_checkpoint(folder: Path, description: dict[str, Any], allowed: Iterable[str]) -> dict[str, Any]:
    """The saved state of a checkpoint (``trainer_state.pt``, with the trainer's counters under
    ``"trainer"``), once its run description matches ``description``.

    Raises:
        ResumeError: a setting or component differs from the saved run's (each one named).
    """
    saved = json.loads((folder / SUMMARY_FILE).read_text())
    problems = _differences(saved, description, allowed)
    if problems:
        raise ResumeError(f"cannot resume from {folder}: " + "; ".join(problems))
    state = torch.load(folder / STATE_FILE, weights_only=False)  # our own file, written by a trainer's save
    if "trainer" not in state:  # format 1: the counters were in the summary and beside the state
        state["trainer"] = {"step": saved["step"], "train_seconds": saved["train_seconds"],
                            "temperature": saved["temperature"], "skipped_steps": saved["skipped_steps"],
                            "skipped_in_a_row": state.pop("skipped_in_a_row"),
                            "zero_std_warned": state.pop("warned_zero_std")}
    return state


def load_weights(model: nn.Module, folder: Path) -> None:
    """Loads the trained weights of a checkpoint: the adapter under peft, else every weight."""
    from safetensors.torch import load_file

    if (folder / "adapter_model.safetensors").is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        if getattr(result, "unexpected_keys", None):
            raise ResumeError(f"{folder}: adapter tensors {result.unexpected_keys[:4]} match no layer of "
                              "this model")
        return
    shards = sorted(folder.glob("model*.safetensors"))
    if not shards:
        raise ResumeError(f"{folder} holds no adapter_model.safetensors nor model*.safetensors; it is not a "
                         "checkpoint of this trainer")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(shard))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    loaded = {p.data_ptr() for name, p in model.named_parameters() if name in weights}
    untied = [k for k in missing if dict(model.named_parameters()).get(k) is None
              or dict(model.named_parameters())[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise ResumeError(f"{folder}: the weights do not fit this model (missing {untied[:4]}, unexpected "
                         f"{unexpected[:4]}); resume with the model the run was started from")


# -- FSDP2: the whole weights and the optimizer's shards ----------------------------------------------------


def gather_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights of an FSDP2-sharded model on rank 0's CPU (a collective: every rank calls it;
    the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shard of the optimizer state, keyed by parameter name, into ``folder`` with
    ``torch.distributed.checkpoint`` (a collective; files fsynced): nothing is gathered on one rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
             storage_writer=dcp.FileSystemWriter(folder))


def load_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Loads a :func:`save_sharded_optimizer` folder into ``optimizer``, resharded for this run: 1/K per
    rank under FSDP2 on any K, or whole (data parallel, one process)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the shapes and placements to fill
    with warnings.catch_warnings():  # one process is what we mean when torch.distributed is not started
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=not dist.is_initialized())
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_whole_optimizer_sharded(model: nn.Module, optimizer: torch.optim.Optimizer,
                                 saved: dict[str, Any]) -> None:
    """Loads the ``optimizer.state_dict()`` of a whole model (one process, data parallel; keyed by
    position) into the optimizer of the same model sharded since: the positions follow the parameter
    order, which sharding keeps, so each becomes its parameter's name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(order) != sum(len(g["params"]) for g in saved["param_groups"]):
        raise ResumeError(f"the saved optimizer holds {sum(len(g['params']) for g in saved['param_groups'])} "
                          f"parameters, this trainer {len(order)}; resume with the model and LoRA plan of "
                          "the run")
    by_name = {"state": {order[i]: value for i, value in saved["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]}
                                for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
