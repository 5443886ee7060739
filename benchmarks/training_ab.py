"""One training-pass setting off and on, in one process: micro-batch forward and backward passes alternating.

    python benchmarks/training_ab.py [--setting keep_logits|compile_training] [--shape llama-small]
        [--prompts 1] [--group-size 4] [--prompt-tokens 32] [--tokens 64] [--passes 12]

What the trainer runs for one micro-batch (``GradientPass._micro_step``): the log-probs of every
completion token through ``completion_logprobs`` (the prompt run once per group, the lm_head pass in
vocabulary tiles of ``MemoryPlan``'s default 32,768 entries, chunks of 256 tokens), inside
``gradients_into_grad``, then ``backward()`` of a weighted sum standing in for the loss. Full
fine-tuning of a random-init model of ``_models.SHAPES``, every completion full-length, one torch
thread. It checks that both settings give the same gradients (exit status 1 if not): bit for bit where
the setting computes the same sums, to float32 rounding where it sums in another order.
Both settings run the same batch, pass after pass in turn, so the machine's drift between runs
(20% a minute apart on ours) hits both alike. The first two passes of each are warm-up; the figure is
the median of the others and their ratio (on / off). Settings:

- ``keep_logits``: the lm_head pass keeps its logits for the backward pass when one tile and one chunk
  hold them (the trainer's pass turns it on); gradients equal bit for bit.
- ``compile_training``: the decoder layers through ``torch.compile`` (``MemoryPlan.compile_training``,
  ``grpo_engine.compiling``), both passes keeping their logits; the compiled kernels sum in another
  order, so the gradients must agree to :data:`COMPILED_TOLERANCE` of each tensor's largest entry. Its
  first pass compiles (about 20 s on 2 cores), inside the warm-up.

Run it alone.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import _harness  # noqa: F401  (puts the repository on sys.path)
import torch
from _models import SHAPES, build_model

from grpo_engine.logprobs import completion_logprobs
from grpo_engine.vocab_tiled import gradients_into_grad

SETTINGS = ("keep_logits", "compile_training")
VOCAB_TILE, CHUNK = 32768, 256  # MemoryPlan's defaults
COMPILED_TOLERANCE = 1e-4  # compiled against eager gradients: largest difference / the tensor's largest entry


def gradient_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference between two gradient lists, each tensor's relative to its largest entry
    (infinite where either holds a NaN or an infinity)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            return math.inf
        scale = max(x.abs().max().item(), y.abs().max().item())
        if scale > 0:
            worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=SETTINGS, default="keep_logits")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-small")
    parser.add_argument("--prompts", type=int, default=1, help="distinct prompts in the micro-batch")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per row")
    parser.add_argument("--passes", type=int, default=12, help="passes per setting, the first 2 not counted")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.passes < 3:
        parser.error(f"--passes {args.passes}: at least 3 (two are warm-up)")
    torch.set_num_threads(args.threads)

    shape = SHAPES[args.shape]
    model = build_model(shape)
    g = torch.Generator().manual_seed(0)
    rows = args.prompts * args.group_size
    prompt_ids = torch.randint(1, shape.vocab, (args.prompts, args.prompt_tokens), generator=g)
    prompt_ids = prompt_ids.repeat_interleave(args.group_size, 0)
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    completion_ids = torch.randint(1, shape.vocab, (rows, args.tokens), generator=g)
    completion_mask = torch.ones_like(completion_ids, dtype=torch.bool)
    weights = torch.randn(rows, args.tokens, generator=g)  # the loss's stand-in: a fixed weighting

    def setting(on: bool) -> dict:
        if args.setting == "keep_logits":
            return {"keep_logits": on}
        return {"keep_logits": True, "compiled": on}

    def one_pass(on: bool) -> float:
        model.zero_grad(set_to_none=False)
        start = time.perf_counter()
        with gradients_into_grad(model):
            logprobs = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                           chunk_size=CHUNK, vocab_tile=VOCAB_TILE, share_prompt=True,
                                           **setting(on))
        (logprobs * weights).sum().backward()
        return time.perf_counter() - start

    seconds: dict[bool, list[float]] = {False: [], True: []}
    grads: dict[bool, list[torch.Tensor]] = {}
    for index in range(args.passes):
        for on in (False, True):
            elapsed = one_pass(on)
            if index >= 2:
                seconds[on].append(elapsed)
            grads[on] = [p.grad.clone() for p in model.parameters()]  # the last pass's
    difference = gradient_difference(grads[False], grads[True])
    same = difference == 0.0 if args.setting == "keep_logits" else difference <= COMPILED_TOLERANCE
    off, on = (statistics.median(seconds[k]) for k in (False, True))
    tokens = rows * args.tokens
    agreement = "equal" if difference == 0.0 else f"{difference:.1e} of the largest entry apart"
    print(f"{args.shape}, {rows} rows x {args.tokens} tokens ({tokens} scored), {args.setting}: off "
          f"{off * 1e3:.1f} ms, on {on * 1e3:.1f} ms per forward and backward pass (medians of "
          f"{args.passes - 2}), on / off {on / off:.2f}; gradients {agreement}"
          f"{'' if same else ' (DIFFERENT)'}")
    print(json.dumps({"setting": args.setting, "shape": args.shape, "rows": rows, "tokens": args.tokens,
                      "off_s": seconds[False], "on_s": seconds[True], "median_off_s": off,
                      "median_on_s": on, "ratio": on / off, "gradient_difference": difference,
                      "same_gradients": same}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
