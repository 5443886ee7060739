"""Does one seed give the same run on this device? Pairs of seeded runs, and a run resumed from a checkpoint.

    python benchmarks/gpu/determinism.py [--cpu] [--settings lora,full] [--out determinism.json]

A seeded GRPO run (``GRPOTrainer.train``) on a random-init model, 4 prompts x 8 completions of 64 tokens,
6 steps, the ``_models.hash_score`` reward; each run in a fresh process:

- ``lora``: the Qwen2.5-0.5B shape in bfloat16 with LoRA r 16 on every linear layer (the GPU path of
  ``examples/gsm8k_lora.py``);
- ``full``: the same shape in float32 master weights under bfloat16 autocast, full fine-tuning (the
  ``gpu-0.5b`` benchmark preset's precision; the tied embedding is trained).

Each is run twice with torch's defaults, then twice with ``torch.use_deterministic_algorithms(True)``
(and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS needs for it); ``lora`` saves a checkpoint every
3 steps, and runs deterministic once more, resumed from its first run's ``checkpoint-3``. For each pair:
the first step whose metrics differ (every metric of ``metrics.jsonl`` but the times), the last step's
two losses, and the largest difference between the two final weights. On the CPU (``--cpu``, one thread)
the ``smoke`` shape in float32 stands in for both (the plumbing, in seconds).

Writes one JSON object (``--out``) after each run and prints a line per comparison; exits 1 only when a
run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

STEPS, SAVE_EVERY = 6, 3


def worker(args: argparse.Namespace) -> None:
    """One seeded run into ``args.dir`` (``metrics.jsonl``, checkpoints, ``final/``)."""
    import torch
    from _models import SHAPES, build_model, hash_score, make_prompts, word_tokenizer

    from grpo_engine import ClippedSurrogate, GRPOConfig, GRPOTrainer, LoRA, MemoryPlan, Prompt, Reward
    from grpo_engine.checkpoint import Resume
    from grpo_engine.data.templates import PlainTemplate

    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    if args.cpu:
        torch.set_num_threads(1)  # the CPU's kernels sum in another order with another thread count

    class HashReward(Reward):
        def score(self, prompt, completion):
            return hash_score(completion)

    device = "cpu" if args.cpu else "cuda"
    shape = "smoke" if args.cpu else "qwen2.5-0.5b"
    lora = args.setting == "lora"
    dtype = "bfloat16" if lora and not args.cpu else "float32"
    model = build_model(shape, seed=0, dtype=dtype, device=device)
    vocab = SHAPES[shape].vocab
    config = GRPOConfig(prompts_per_step=4, group_size=8, max_prompt_tokens=32, max_completion_tokens=64,
                        max_steps=STEPS, learning_rate=1e-5 if not lora else 1e-4, lr_schedule="constant",
                        warmup_steps=0, seed=0, save_every_steps=SAVE_EVERY if lora else None,
                        output_dir=args.dir, progress_bar=False)
    memory = MemoryPlan(lora=LoRA(r=16, alpha=32, target_modules="all-linear") if lora else None,
                        dtype=dtype, micro_batch_size=8,
                        compute_dtype="bfloat16" if not lora and not args.cpu else None)
    prompts = [Prompt(t) for t in make_prompts(64, 32, vocab, seed=0)]
    trainer = GRPOTrainer(model, [HashReward()], prompts, config, memory, tokenizer=word_tokenizer(vocab),
                          loss=ClippedSurrogate(), template=PlainTemplate("{question}"),
                          resume_from=None if args.resume is None else Resume(
                              args.resume, allow_changes={"config.output_dir"}))  # a copied checkpoint
    trainer.train()
    print(json.dumps({"decoding": trainer.sampler.last_decoding.get("path"),
                      "capture_error": trainer.sampler.last_decoding.get("capture_error")}), flush=True)


def _metrics(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_per_s")}
            for r in rows]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted((folder / "final").glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def compare(a: Path, b: Path, *, from_step: int = 1) -> dict:
    """The first differing step (None: every step equal), the last loss gap, the largest weight gap."""
    ma = {r["step"]: r for r in _metrics(a)}
    mb = {r["step"]: r for r in _metrics(b)}
    steps = sorted(s for s in set(ma) & set(mb) if s >= from_step)
    first = next((s for s in steps if ma[s] != mb[s]), None)
    last = steps[-1]
    wa, wb = _weights(a), _weights(b)
    gap = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    scale = max(float(w.float().abs().max()) for w in wa.values())
    return {"steps_compared": steps, "first_differing_step": first,
            "last_loss": [ma[last].get("loss"), mb[last].get("loss")],
            "max_weight_diff": gap, "max_weight": scale, "same_weights": gap == 0.0}


def _said(pair: dict) -> str:
    weights = "equal" if pair["same_weights"] else f"differ by {pair['max_weight_diff']:.3g}"
    return f"first differing step {pair['first_differing_step']}, final weights {weights}"


def run_one(name: str, folder: Path, setting: str, deterministic: bool, cpu: bool,
            resume: str | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    cmd = [sys.executable, __file__, "--worker", "--setting", setting, "--dir", str(folder)]
    cmd += (["--deterministic"] if deterministic else []) + (["--cpu"] if cpu else [])
    cmd += ["--resume", resume] if resume else []
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    info = {"name": name, "rc": proc.returncode, "seconds": round(time.perf_counter() - start, 1)}
    if proc.returncode != 0:
        info["error"] = proc.stderr[-1500:]
    else:
        info.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    said = f", decoding {info.get('decoding')}" if proc.returncode == 0 else f"\n{info['error']}"
    print(f"run {name}: rc {proc.returncode}, {info['seconds']} s{said}", flush=True)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU smoke run (smoke shape)")
    parser.add_argument("--settings", default="lora,full", help="which runs: lora, full or both")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work", type=Path, help="keep the runs' folders here (default: a temporary folder, "
                        "removed at the end)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=("lora", "full"), help=argparse.SUPPRESS)
    parser.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    settings = args.settings.split(",")
    if not settings or set(settings) - {"lora", "full"}:
        parser.error(f"--settings {args.settings!r}: each must be lora or full (e.g. --settings lora,full)")
    root = args.work if args.work is not None else Path(tempfile.mkdtemp(prefix="determinism-"))
    try:
        return _check(root, settings, args)
    finally:
        if args.work is None:
            shutil.rmtree(root, ignore_errors=True)


def _check(root: Path, settings: list[str], args: argparse.Namespace) -> int:
    result: dict = {"device": "cpu" if args.cpu else "cuda", "steps": STEPS, "runs": [], "pairs": {}}

    def save():
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))

    failed = False
    for setting in settings:
        for mode, deterministic in (("default", False), ("deterministic", True)):
            names = [f"{setting}-{mode}-{i}" for i in (1, 2)]
            for name in names:
                result["runs"].append(run_one(name, root / name, setting, deterministic, args.cpu))
                failed |= result["runs"][-1]["rc"] != 0
                save()
            if all((root / n / "final").is_dir() for n in names):
                pair = result["pairs"][f"{setting}-{mode}"] = compare(root / names[0], root / names[1])
                print(f"{setting}, {mode}: {_said(pair)}", flush=True)
                save()
        first = root / "lora-deterministic-1"  # a LoRA run resumes from its checkpoint
        if setting == "lora" and (first / f"checkpoint-{SAVE_EVERY}").is_dir():
            resumed = root / "lora-deterministic-resumed"
            shutil.copytree(first / f"checkpoint-{SAVE_EVERY}", resumed / f"checkpoint-{SAVE_EVERY}")
            result["runs"].append(run_one("lora-deterministic-resumed", resumed, "lora", True, args.cpu,
                                          resume="latest"))
            failed |= result["runs"][-1]["rc"] != 0
            if (resumed / "final").is_dir():
                pair = result["pairs"]["lora-deterministic-resumed"] = compare(first, resumed,
                                                                               from_step=SAVE_EVERY + 1)
                print(f"lora, deterministic, resumed at step {SAVE_EVERY}: {_said(pair)}", flush=True)
            save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
