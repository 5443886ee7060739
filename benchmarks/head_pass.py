"""The output layer's training pass side by side: the log-probs of the sampled tokens from hidden states and
a clipped GRPO loss, forward and backward, on the same inputs, five ways. Which is fastest on a GPU, at
what memory, with the same numbers?

    python benchmarks/head_pass.py [--out head_pass.json]   # a GPU: the Qwen2.5-0.5B and -1.5B presets' heads
    python benchmarks/head_pass.py --smoke                   # the CPU: tiny shapes, the agreement only

One case is one micro-batch of the GPU presets (benchmarks/perf.py): hidden states [k, H] (k = rows x
tokens, the micro-batch's trained tokens), the lm_head weight [V, H], the sampled tokens [k], one
advantage per row, and old log-probs (the reference pass's, shifted by 0 or +-0.5, so that some ratios
are clipped). gpu-0.5b: float32 master weights under bfloat16 autocast, the head trained (tied
embeddings: full fine-tuning trains it); gpu-1.5b: bfloat16 weights, the head frozen (LoRA leaves it).

Arms, each the forward pass, the loss and ``backward()``:

- ``ours-tiled``: ``grpo_engine.logprobs.selective_logprobs`` at the granularity the plan used on every
  device until now (256-token chunks x 32,768-entry vocabulary tiles; on the smoke shapes 16 x 256),
  inside ``gradients_into_grad`` as the trainer calls it;
- ``ours-one``: the same, one chunk and one tile (``chunk_size=k, vocab_tile=V, keep_logits=True``);
- ``plain``: the full logits as a hand-written loop (and TRL before its fused head) computes them:
  ``hidden @ W.T`` in the compute dtype, ``.float()``, ``log_softmax``, ``gather``;
- ``trl``: TRL's own fused head (``trl.kernels.ChunkedLogProbFunction``, what TRL 1.16's GRPOTrainer
  trains with: cuBLAS on 4,096-token x 32,768-entry tiles folded by a Triton kernel; torch operations
  on the CPU);
- ``liger``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (the loss fused in, its gradients computed in
  the forward pass; ``torch.compile``d loss on a GPU as Liger's default, eager on the CPU).

The first four apply ``grpo_engine.losses.ClippedSurrogate`` (token aggregation, clip 0.2, no KL); Liger
its own ``loss_type="dapo"`` with the same clip, the same objective. Before any timing every arm's loss
and gradients (hidden states; the weight where the head trains) are checked against a reference pass
(the plain one in float32 on a GPU, float64 on the CPU): relative error (the gradients' as norms, the
loss's against the mean |advantage|) at most 1e-4 with float32 compute, 3e-2 with bfloat16. Then each
arm runs ``repetitions`` times in rotated order (CUDA events around forward + backward) with the peak
allocated memory above what was allocated before it (the inputs and the weight); the check's run is the
warm-up (Triton's JIT, Liger's compile). On the CPU the check is the result: its times are not figures.
An arm whose library does not import, or whose run fails (out of memory, say), is reported under
``skipped`` with the reason, and the others go on.

One worker runs every case (one launch, one set of imports) and prints its result after each case;
the parent writes the JSON (``--out``) and one summary line per case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _harness as harness

ARMS = ("ours-tiled", "ours-one", "plain", "trl", "liger")
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
OPTIONAL = {"trl": "trl.kernels", "liger": "liger_kernel.chunked_loss"}  # the arm and the module it needs


@dataclasses.dataclass(frozen=True)
class Case:
    """One micro-batch's output layer (module docstring)."""

    name: str
    hidden: int  # H
    vocab: int  # V
    rows: int  # completions in the micro-batch
    tokens: int  # trained tokens per row (prompt + completion)
    weight_dtype: str  # the head weight's (float32: master weights under autocast)
    compute_dtype: str  # the matrix products'
    train_head: bool  # the weight's gradient is computed (full fine-tuning)
    chunk: int = 256  # ours-tiled's chunk and tile
    tile: int = 32_768
    seed: int = 0

    @property
    def k(self) -> int:
        return self.rows * self.tokens

    @property
    def autocast(self) -> bool:
        return self.compute_dtype != self.weight_dtype


CASES = {
    "gpu-0.5b": Case("gpu-0.5b", hidden=896, vocab=151_936, rows=16, tokens=640, weight_dtype="float32",
                     compute_dtype="bfloat16", train_head=True),
    "gpu-1.5b": Case("gpu-1.5b", hidden=1536, vocab=151_936, rows=8, tokens=1152, weight_dtype="bfloat16",
                     compute_dtype="bfloat16", train_head=False),
}
SMOKE = {
    "smoke-float32": Case("smoke-float32", hidden=64, vocab=1000, rows=2, tokens=24, weight_dtype="float32",
                          compute_dtype="float32", train_head=True, chunk=16, tile=256),
    "smoke-bfloat16": Case("smoke-bfloat16", hidden=64, vocab=1000, rows=2, tokens=40,
                           weight_dtype="bfloat16", compute_dtype="bfloat16", train_head=False, chunk=16,
                           tile=256),
}


# -- the inputs and the arms ------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    hidden: object  # [k, H] leaf tensor, requires grad
    head: object  # nn.Linear(H, V, bias=False): its weight [V, H]
    targets: object  # [k]
    mask: object  # [rows, tokens] bool, all True
    advantages: object  # [rows]
    old: object  # [rows, tokens] old log-probs


def make_inputs(case: Case, device: str) -> Inputs:
    """The case's inputs, the same for every arm (seeded on the CPU, then moved)."""
    import torch

    g = torch.Generator().manual_seed(case.seed)
    hidden_dtype = "float32" if case.autocast else case.compute_dtype
    hidden = torch.randn(case.k, case.hidden, generator=g).to(device, getattr(torch, hidden_dtype))
    head = torch.nn.Linear(case.hidden, case.vocab, bias=False, device=device,
                           dtype=getattr(torch, case.weight_dtype))
    with torch.no_grad():  # logits of std ~2, as a trained model's are
        head.weight.copy_(torch.randn(case.vocab, case.hidden, generator=g) * 2 / case.hidden**0.5)
    head.weight.requires_grad_(case.train_head)
    targets = torch.randint(0, case.vocab, (case.k,), generator=g).to(device)
    advantages = torch.randn(case.rows, generator=g).to(device)
    shift = (torch.randint(0, 3, (case.rows, case.tokens), generator=g) - 1).float() * 0.5
    inputs = Inputs(hidden.requires_grad_(True), head, targets,
                    torch.ones(case.rows, case.tokens, dtype=torch.bool, device=device), advantages, None)
    reference = _reference_logprobs(inputs, device)
    inputs.old = reference.view(case.rows, case.tokens) + shift.to(device)  # ratios 1, e^0.5, e^-0.5
    return inputs


def _reference_logprobs(inputs: Inputs, device: str):
    import torch

    dtype = torch.float64 if device == "cpu" else torch.float32
    with torch.no_grad():
        logits = inputs.hidden.detach().to(dtype) @ inputs.head.weight.detach().to(dtype).T
        return logits.log_softmax(-1).gather(-1, inputs.targets[:, None]).squeeze(-1).float()


def _loss(logprobs, inputs: Inputs, case: Case):
    from grpo_engine.losses import ClippedSurrogate
    from grpo_engine.types import MicroBatch

    micro = MicroBatch(completion_mask=inputs.mask, advantages=inputs.advantages, old_logprobs=inputs.old)
    loss = ClippedSurrogate(clip_eps_low=0.2, aggregation="token")
    return loss(logprobs.view(case.rows, case.tokens), micro, num_valid_tokens=case.k,
                num_sequences=case.rows).loss


def _autocast(case: Case, device: str):
    import contextlib

    import torch

    if not case.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=getattr(torch, case.compute_dtype))


def arm_function(arm: str, case: Case, device: str) -> Callable:
    """``run(inputs) -> loss`` for one arm; the caller calls ``backward()`` (outside autocast, as the
    trainer does)."""
    import torch

    if arm in ("ours-tiled", "ours-one"):
        from grpo_engine.logprobs import selective_logprobs
        from grpo_engine.vocab_tiled import gradients_into_grad

        one = arm == "ours-one"
        chunk, tile = (case.k, case.vocab) if one else (case.chunk, case.tile)

        def run(x: Inputs):
            with _autocast(case, device), gradients_into_grad():
                lp = selective_logprobs(x.hidden, x.head, x.targets, chunk_size=chunk, vocab_tile=tile,
                                        keep_logits=one)
                return _loss(lp, x, case)
    elif arm == "plain":
        def run(x: Inputs):
            with _autocast(case, device):
                logits = torch.nn.functional.linear(x.hidden, x.head.weight).float()
                lp = logits.log_softmax(-1).gather(-1, x.targets[:, None]).squeeze(-1)
                return _loss(lp, x, case)
    elif arm == "trl":
        from trl.kernels import ChunkedLogProbFunction

        def run(x: Inputs):
            with _autocast(case, device):  # TRL's GRPOTrainer: 32,768-entry vocabulary tiles, no extras
                lp = ChunkedLogProbFunction.apply(x.hidden, x.head.weight, None, x.targets, 1.0, 32_768, None,
                                                  1.0, ())[0]
                return _loss(lp, x, case)
    elif arm == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        fused = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=device == "cuda",
                                         epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo", temperature=1.0)

        def run(x: Inputs):
            with _autocast(case, device):
                loss, _ = fused(x.hidden.view(case.rows, case.tokens, case.hidden), x.head.weight,
                                x.targets.view(case.rows, case.tokens), x.mask.float(), x.advantages,
                                old_per_token_logps=x.old)
                return loss
    else:
        raise ValueError(f"arm={arm!r} is not one of {ARMS}")
    return run


def missing(arm: str) -> str | None:
    """Why an arm cannot run here (its library does not import), None when it can."""
    import importlib

    if arm not in OPTIONAL:
        return None
    try:
        importlib.import_module(OPTIONAL[arm])
    except Exception as error:  # an import can fail with any error
        return f"import {OPTIONAL[arm]} failed ({type(error).__name__}: {str(error)[:160]})"
    return None


# -- running one arm -----------------------------------------------------------------------------------


def run_once(run: Callable, inputs: Inputs, device: str) -> dict:
    """Forward + backward once: the loss, the gradients (on the CPU, float64), the time and the peak
    allocated memory above what was allocated before (GPU only)."""
    import torch

    inputs.hidden.grad = None
    inputs.head.weight.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        began = time.perf_counter()
    loss = run(inputs)
    loss.backward()
    if device == "cuda":
        end.record()
        end.synchronize()
        ms, peak = start.elapsed_time(end), (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        ms, peak = (time.perf_counter() - began) * 1000, None
    grad_w = inputs.head.weight.grad
    return {"loss": loss.detach().double().cpu(), "grad_hidden": inputs.hidden.grad.detach().double().cpu(),
            "grad_weight": grad_w.detach().double().cpu() if grad_w is not None else None, "ms": ms,
            "peak_mib": peak}


def agreement(found: dict, reference: dict, scale: float) -> dict:
    """Relative errors of an arm's loss and gradients against the reference's: the loss's against
    ``scale`` (the mean |advantage|, the size of a token's loss, which a mean of signed terms is not),
    the gradients' as norms.

    Example:
        >>> import torch
        >>> ref = {"loss": torch.tensor(0.25), "grad_hidden": torch.ones(4), "grad_weight": None}
        >>> agreement({**ref, "loss": torch.tensor(0.5)}, ref, scale=0.5)
        {'loss': 0.5, 'grad_hidden': 0.0, 'grad_weight': None}
    """
    def rel(a, b) -> float | None:
        if a is None or b is None:
            return None
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    return {"loss": round(abs(float(found["loss"] - reference["loss"])) / scale, 12),
            "grad_hidden": rel(found["grad_hidden"], reference["grad_hidden"]),
            "grad_weight": rel(found["grad_weight"], reference["grad_weight"])}


def _reference(inputs: Inputs, case: Case, device: str) -> dict:
    """The plain pass in float32 (GPU) or float64 (CPU), no autocast: what every arm is checked against."""
    import torch

    dtype = torch.float64 if device == "cpu" else torch.float32
    hidden = inputs.hidden.detach().to(dtype).requires_grad_(True)
    weight = inputs.head.weight.detach().to(dtype).requires_grad_(case.train_head)
    logits = hidden @ weight.T
    lp = logits.log_softmax(-1).gather(-1, inputs.targets[:, None]).squeeze(-1)
    loss = _loss(lp, inputs, case)
    loss.backward()
    out = {"loss": loss.detach().double().cpu(), "grad_hidden": hidden.grad.double().cpu(),
           "grad_weight": weight.grad.double().cpu() if case.train_head else None}
    del logits, lp, loss, hidden, weight
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def measure_case(case: Case, device: str, repetitions: int, arms: tuple[str, ...]) -> dict:
    """Checks every arm against the reference, then times them in rotated order (module docstring)."""
    times: dict[str, float] = {}
    inputs = make_inputs(case, device)
    reference = _reference(inputs, case, device)
    times["built_s"] = _since_launch()
    skipped = {arm: why for arm in arms if (why := missing(arm)) is not None}
    runnable = [arm for arm in arms if arm not in skipped]
    runs = {arm: arm_function(arm, case, device) for arm in runnable}
    tolerance = TOLERANCE[case.compute_dtype]
    scale = float(inputs.advantages.abs().mean())
    results: dict[str, dict] = {}
    for arm in list(runnable):  # the check, and the warm-up
        try:
            found = run_once(runs[arm], inputs, device)
        except RuntimeError as error:  # out of memory, a kernel that does not build: this arm only
            skipped[arm] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            runnable.remove(arm)
            _free(device)
            continue
        check = agreement(found, reference, scale)
        worst = max(v for v in check.values() if v is not None)
        results[arm] = {"check": check, "ok": worst <= tolerance, "loss": float(found["loss"]),
                        "ms": [], "peak_mib": None}
    times["checked_s"] = _since_launch()
    for _, arm in harness.schedule(runnable, range(repetitions), rotate=True):
        found = run_once(runs[arm], inputs, device)
        results[arm]["ms"].append(found["ms"])
        if found["peak_mib"] is not None:
            results[arm]["peak_mib"] = max(results[arm]["peak_mib"] or 0.0, found["peak_mib"])
    times["timed_s"] = _since_launch()
    flops = 2 * case.k * case.vocab * case.hidden * (3 if case.train_head else 2)  # fwd, d hidden, d weight
    for r in results.values():
        r["median_ms"] = harness.median(r["ms"])
        r["tflops"] = flops / (r["median_ms"] / 1000) / 1e12 if r["median_ms"] else None
    return {"case": dataclasses.asdict(case), "k": case.k, "tolerance": tolerance, "flops": flops,
            "reference_loss": float(reference["loss"]), "arms": results, "skipped": skipped,
            "ok": all(r["ok"] for r in results.values()), "times": times}


def _free(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _since_launch() -> float:
    return round(time.time() - harness.launched_at(), 2)


def worker(names: list[str], smoke: bool, repetitions: int, arms: tuple[str, ...]) -> dict:
    """Every case in this process; prints the result so far after each case."""
    import torch

    device = "cpu" if smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"head_pass: torch {torch.__version__} sees no GPU (use --smoke on a CPU)")
    if smoke:
        torch.set_num_threads(1)
    import grpo_engine.logprobs  # noqa: F401 - the import time is the timeline's first mark

    cases = SMOKE if smoke else CASES
    result = {"device": device, "hardware": harness.hardware(device),
              "times": {"imported_s": _since_launch()}, "cases": []}
    for name in names:
        result["cases"].append(measure_case(cases[name], device, repetitions, arms))
        harness.emit_partial(result)
    return result


# -- the parent ----------------------------------------------------------------------------------------


def summary_line(case: dict, device: str) -> str:
    """One case in one line: each arm's time and memory (GPU), the fastest, the agreement."""
    c, arms = case["case"], case["arms"]
    parts = []
    for arm, r in arms.items():
        if device == "cuda":
            memory = f" {r['peak_mib'] / 1024:.2f} GiB" if r["peak_mib"] is not None else ""
            parts.append(f"{arm} {r['median_ms']:.0f} ms{memory}")
        else:
            parts.append(f"{arm} {'ok' if r['ok'] else 'DIFFERS'}")
    worst = max((max(v for v in r["check"].values() if v is not None) for r in arms.values()), default=None)
    head = "trained" if c["train_head"] else "frozen"
    line = (f"head pass {c['name']} ({case['k']:,} tokens x {c['hidden']} -> {c['vocab']:,}, {head} head, "
            f"{c['compute_dtype']}): " + " | ".join(parts))
    if device == "cuda" and arms:
        line += f"; fastest {min(arms, key=lambda a: arms[a]['median_ms'])}"
    if worst is not None:
        line += (f"; {'all agree' if case['ok'] else 'NOT all agree'} with the reference "
                 f"(largest relative error {worst:.1e}, tolerance {case['tolerance']:.0e})")
    if case["skipped"]:
        line += "; skipped: " + ", ".join(f"{a} ({why})" for a, why in case["skipped"].items())
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes: the agreement check only")
    parser.add_argument("--cases", help=f"comma-separated subset (default: all; GPU: {', '.join(CASES)})")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    parser.add_argument("--repetitions", type=int,
                        help="timed runs per arm (default: 3 on a GPU, 1 on the CPU)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the worker's time limit")
    parser.add_argument("--deadline", type=float, help="epoch seconds by which the worker must have ended")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--log", type=Path, help="append the worker's stderr to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.cases.split(",") if args.cases else list(SMOKE if args.smoke else CASES)
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    known = SMOKE if args.smoke else CASES
    unknown = [n for n in names if n not in known] + [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"head_pass: unknown case or arm {unknown}; cases {list(CASES)} (GPU) or "
                         f"{list(SMOKE)} (--smoke), arms {list(ARMS)}")
    repetitions = args.repetitions or (1 if args.smoke else 3)
    if args.worker:
        harness.emit(worker(names, args.smoke, repetitions, arms))
        return 0
    command = [str(Path(__file__).resolve()), "--worker", "--cases", ",".join(names), "--arms",
               ",".join(arms), "--repetitions", str(repetitions)] + (["--smoke"] if args.smoke else [])
    timeout = harness.time_limit(args.timeout_s, args.deadline)
    if timeout is None:
        raise SystemExit("head_pass: under 10 s left before --deadline; nothing ran")
    harness.say("head_pass", f"{len(names)} case(s), arms {', '.join(arms)} (limit {timeout:.0f} s)")
    result, error = harness.run_worker("head_pass", command, timeout, harness.worker_env(), args.log)
    report = {**(result or {"device": "cpu" if args.smoke else "cuda", "cases": []}),
              "versions": {**harness.versions(), **_more_versions()}, "commit": harness.git_commit(),
              "errors": [error] if error else []}
    report["ok"] = bool(report["cases"]) and all(c["ok"] for c in report["cases"]) and not error
    if args.out is not None:
        harness.write_report(args.out, report)
    for case in report["cases"]:
        print(summary_line(case, report["device"]), flush=True)
    for e in report["errors"]:
        print(f"ERROR: {e.splitlines()[0]}", flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}), flush=True)
    return 0 if report["ok"] else 1


def _more_versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for name in ("liger-kernel", "triton"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
