"""One sampler setting off and on, in one process: ``HFSampler.sample`` calls alternating between the two.

    python benchmarks/sampler_ab.py [--setting pack_weights] [--shape llama-small] [--decoding compiled]
        [--prompts 2] [--group-size 4] [--prompt-tokens 32] [--tokens 64] [--calls 12] [--lora-r 0]
    python benchmarks/sampler_ab.py --products [--shape qwen2.5-0.5b] [--prompts 2] [--group-size 4]

The machines these benchmarks run on drift by 20% between runs a minute apart, which hides a 15%
change between two perf.py runs. Here both settings sample the same random-init model (the shapes of
``_models.SHAPES``, every completion full-length) with the same prompts and seeds, call after call in
turn, so a drift hits both alike. The first two calls of each are warm-up (a compile, for
``--decoding compiled``); the figure is the median of the others and their ratio (on / off). Settings:
``pack_weights`` (``MemoryPlan.pack_weights_for_sampling``), ``merge_lora``
(``merge_lora_for_sampling``; needs ``--lora-r``), ``compiled_products``
(``compiled_products_for_sampling``; needs ``--decoding compiled``). One torch thread, as perf.py's CPU
presets; run it alone.

``--products`` times the products instead, for each linear weight shape of the model, with prompts x
group size rows: one plain product (``F.linear``), one with the packed copy as eager code runs it, the
same through the custom op a compiled step calls, and the packing itself (medians; each weight alone, so
it stays in the CPU's caches); then every product of one step (each layer once) in one compiled function,
as BLAS matrix products and as reductions (``compiled_products``), the weights passing through the caches
as in a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import _harness  # noqa: F401  (puts the repository on sys.path)
import torch
import torch.nn.functional as F
from _models import SHAPES, build_model, make_prompts, word_tokenizer

from grpo_engine.data.templates import PlainTemplate
from grpo_engine.sampling import HFSampler
from grpo_engine.sampling.compiled_products import product_as_reduction, reducible_layers
from grpo_engine.types import Prompt

SETTINGS = ("pack_weights", "merge_lora", "compiled_products")


def _median_s(fn, seconds: float = 0.3) -> float:
    """The median time of ``fn()`` over about ``seconds`` of calls (at least 5), after two warm-up calls."""
    fn(), fn()
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    times = []
    for _ in range(max(5, int(seconds / max(once, 1e-6)))):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_product(rows_out: int, cols: int, rows: int) -> dict:
    from grpo_engine.sampling import packed

    layer, x = torch.nn.Linear(cols, rows_out, bias=False), torch.randn(rows, cols)
    with torch.no_grad():
        plain = _median_s(lambda: F.linear(x, layer.weight))
        pack = _median_s(lambda: torch.ops.mkldnn._reorder_linear_weight(layer.weight, rows), 1.0)
        with packed.packed_linears(layer, rows=rows):
            direct = _median_s(lambda: packed._product(x, layer.weight, None))  # what eager layers run
            op = _median_s(lambda: packed.packed_linear(x, layer.weight, None))
    print(f"{rows_out} x {cols}, {rows} rows: plain {plain * 1e6:.0f} us, packed {direct * 1e6:.0f} us "
          f"({direct / plain:.2f}), through the custom op {op * 1e6:.0f} us, packing {pack * 1e3:.1f} ms "
          f"({pack / plain:.1f} plain products)")
    return {"shape": [rows_out, cols], "plain_s": plain, "packed_s": direct, "custom_op_s": op,
            "pack_s": pack}


def time_products(shape_name: str, rows: int) -> list[dict]:
    """For each linear weight shape of ``shape_name``: the timings of ``--products``."""
    model = build_model(SHAPES[shape_name])
    shapes = sorted({tuple(m.weight.shape) for m in reducible_layers(model)})
    return [_time_product(rows_out, cols, rows) for rows_out, cols in shapes]


def time_step_products(shape_name: str, rows: int) -> dict:
    """Every linear product of one decoding step of ``shape_name`` (each layer once, in the model's
    order), in one compiled function: as BLAS matrix products, and as reductions."""
    model = build_model(SHAPES[shape_name])
    weights = [m.weight.detach() for m in reducible_layers(model)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    kinds = {"blas": lambda x, w: F.linear(x, w), "reduction": lambda x, w: product_as_reduction(x, w, None)}
    seconds = {}
    with torch.no_grad():
        for kind, product in kinds.items():
            step = torch.compile(lambda xs, ws, product=product: [product(xs[w.shape[1]], w) for w in ws],
                                 dynamic=False)
            seconds[kind] = _median_s(lambda step=step: step(inputs, weights), 1.0)
    print(f"the {len(weights)} products of one step in one compiled function, {rows} rows: BLAS "
          f"{seconds['blas'] * 1e3:.2f} ms, reductions {seconds['reduction'] * 1e3:.2f} ms "
          f"({seconds['reduction'] / seconds['blas']:.2f})")
    return {"products": len(weights), "blas_s": seconds["blas"], "reduction_s": seconds["reduction"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=SETTINGS, default="pack_weights")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-small")
    parser.add_argument("--decoding", default="compiled", help="MemoryPlan.decoding of both samplers")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens (every one is generated)")
    parser.add_argument("--calls", type=int, default=12, help="calls per setting, the first 2 not counted")
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank on every linear layer (0: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--products", action="store_true", help="time the products and the packing instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.products:
        rows = args.prompts * args.group_size
        print(json.dumps({"shape": args.shape, "rows": rows, "products": time_products(args.shape, rows),
                          "step_products": time_step_products(args.shape, rows)}))
        return 0
    if args.calls < 3:
        parser.error(f"--calls {args.calls}: at least 3 (two are warm-up)")
    if args.setting == "merge_lora" and not args.lora_r:
        parser.error("--setting merge_lora needs an adapter to merge: pass --lora-r 16")
    if args.setting == "compiled_products" and args.decoding != "compiled":
        parser.error(f"--setting compiled_products changes the compiled step: --decoding compiled, not "
                     f"{args.decoding!r}")

    shape = SHAPES[args.shape]
    model, tokenizer = build_model(shape), word_tokenizer(shape.vocab)
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                                 target_modules="all-linear"))
        for name, param in model.named_parameters():
            if "lora_B" in name:  # a non-zero adapter, as after training
                torch.nn.init.normal_(param, std=0.02)
    prompts = [Prompt(t) for t in make_prompts(args.prompts, args.prompt_tokens, shape.vocab)]
    common = dict(template=PlainTemplate("{question}"), max_prompt_tokens=args.prompt_tokens,
                  max_completion_tokens=args.tokens, decoding=args.decoding)
    samplers = {on: HFSampler(model, tokenizer, **common, **{args.setting: on}) for on in (False, True)}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for call in range(args.calls):
        for on in (False, True):
            torch.manual_seed(call)
            start = time.perf_counter()
            samplers[on].sample(prompts, group_size=args.group_size)
            if call >= 2:
                seconds[on].append(time.perf_counter() - start)
    off, on = (statistics.median(seconds[k]) for k in (False, True))
    rows = args.prompts * args.group_size
    print(f"{args.shape}, {rows} rows x {args.tokens} tokens, decoding={args.decoding}, {args.setting}: "
          f"off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms per sample() call (medians of {args.calls - 2}), "
          f"on / off {on / off:.2f}")
    print(json.dumps({"setting": args.setting, "shape": args.shape, "decoding": args.decoding, "rows": rows,
                      "tokens": args.tokens, "off_s": seconds[False], "on_s": seconds[True],
                      "median_off_s": off, "median_on_s": on, "ratio": on / off}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
