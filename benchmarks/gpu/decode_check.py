"""Checks and times the decoding paths on one device before the presets run.

    python benchmarks/gpu/decode_check.py [--cpu] [--part agreement|speed|all] [--out decode_check.json]

1. Agreement, in float32 on a Qwen2.5-0.5B-shaped random model (``--shape``; the smoke shape on the CPU,
   and in the GPU run, whose time plan has no room for compiling a 24-layer step once more): greedy
   completions of ragged prompts, with an EOS that rows reach at different steps, from the dynamic
   loop, the static path and (on a GPU) the CUDA-graph replay: the same tokens, and log-probs that
   differ by float rounding only. A CUDA graph that could not be captured fails the check (the
   static path falls back to eager decoding, which would otherwise pass as "the same tokens").
2. Speed, on the gpu-1.5b preset's model: the Qwen2.5-1.5B shape in bfloat16 with its LoRA (r 16 on
   every linear layer; the smoke shape on the CPU): 32 rows (4 prompts x 8) decoding a fixed number
   of tokens on each path; tokens/s per path, and the path ``auto`` picks.

Writes one JSON object (``--out``) after each part, with the seconds from the launch to the end of
the imports and of each part (``times``), prints a line per part, and exits 1 when the paths disagree
or the capture failed. ``--part`` runs one part: the GPU run checks the agreement in its first run and
times the paths in its second (benchmarks/gpu/run.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

STARTED = time.time()  # before the heavy imports: the first mark of the timeline is their end

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402
from _models import build_model, make_prompts, word_tokenizer  # noqa: E402

from grpo_engine.sampling.decode import TokenDraw, decode  # noqa: E402
from grpo_engine.sampling.hf import resolve_decoding  # noqa: E402
from grpo_engine.sampling.static import decode_static  # noqa: E402


def _since_start() -> float:
    return round(time.time() - STARTED, 2)


def _run(path: str, model, ids, mask, info: dict | None = None, **kw):
    """One decoding path; ``info`` gets the static path's ``path`` and ``capture_error``."""
    if path == "dynamic":
        return decode(model, ids, mask, **kw)
    return decode_static(model, ids, mask, mode="eager" if path == "static" else path, info=info, **kw)


def _with_lora(model, r: int = 16):
    """The model with a LoRA adapter on every linear layer (the gpu-1.5b preset's), in eval mode."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(model, config).eval()


def _prompts(shape: str, device: str, count: int, width: int):
    """Left-padded prompts of different lengths (width, width - 3, width - 6, ...)."""
    from _models import SHAPES

    vocab = SHAPES[shape].vocab
    tok = word_tokenizer(vocab)
    enc = tok(make_prompts(count, width, vocab), return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    for row in range(count):
        cut = 3 * row % width
        ids[row, :cut], mask[row, :cut] = 0, False
    return ids.to(device), mask.to(device)


@torch.no_grad()
def agreement(shape: str, device: str, paths: list[str], new_tokens: int = 24) -> dict:
    model = build_model(shape, dtype="float32", device=device)
    ids, mask = _prompts(shape, device, 4, 24)
    free, _ = decode(model, ids, mask, repeats=1, max_new_tokens=12, eos_ids=[-1], pad_id=0,
                     draw=TokenDraw(greedy=True, logprobs=False))
    eos = int(free[0, 5])  # row 0 ends at its sixth token; others end elsewhere or run on
    out, infos = {}, {}
    for path in paths:
        infos[path] = {}
        out[path] = _run(path, model, ids, mask, infos[path], repeats=2, max_new_tokens=new_tokens,
                         eos_ids=[eos],
                         pad_id=0, draw=TokenDraw(greedy=True, logprobs=True))
    base_ids, base_lp = out["dynamic"]
    return {"paths": paths, "eos_rows": int((base_ids == eos).any(1).sum()), "rows": int(base_ids.shape[0]),
            "same_tokens": {p: bool(torch.equal(base_ids, out[p][0])) for p in paths},
            "max_logprob_diff": {p: float((base_lp - out[p][1]).abs().max()) for p in paths},
            "capture_error": infos.get("cuda_graph", {}).get("capture_error")}


@torch.no_grad()
def speed(shape: str, device: str, paths: list[str], new_tokens: int) -> dict:
    model = _with_lora(build_model(shape, dtype="bfloat16" if device == "cuda" else "float32", device=device))
    ids, mask = _prompts(shape, device, 4, 128 if device == "cuda" else 16)
    kw = dict(repeats=8, max_new_tokens=new_tokens, eos_ids=[-1], pad_id=0, draw=TokenDraw(temperature=1.0))
    out = {}
    for path in paths:
        info: dict = {}
        _run(path, model, ids, mask, **kw)  # warm-up (kernels, allocator)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _run(path, model, ids, mask, info, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out[path] = {"seconds": seconds, "tokens_per_s": 32 * new_tokens / seconds,
                     "ran": info.get("path", path), "capture_error": info.get("capture_error")}
    return {"rows": 32, "new_tokens": new_tokens, "lora_r": 16, "paths": out,
            "auto": resolve_decoding("auto", model, torch.device(device))}


def _paths(device: str) -> list[str]:
    return ["dynamic", "static"] + (["cuda_graph"] if device == "cuda" else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU smoke run (smoke shape, no CUDA graph)")
    parser.add_argument("--part", choices=("agreement", "speed", "all"), default="all")
    parser.add_argument("--shape", help="the agreement's model (default: qwen2.5-0.5b; smoke on the CPU)")
    parser.add_argument("--new-tokens", type=int, default=24,
                        help="the agreement's tokens per row (past 104, a GPU's graphs cross a width bucket)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    paths = _paths(device)
    result: dict = {"device": device, "times": {"imported_s": _since_start()}, "ok": True}
    if args.part in ("agreement", "all"):
        shape = args.shape or ("smoke" if args.cpu else "qwen2.5-0.5b")
        result["ok"] = _agreement_part(result, shape, device, paths, args.new_tokens)
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))
    if args.part in ("speed", "all"):
        result["speed"] = speed("smoke" if args.cpu else "qwen2.5-1.5b", device, paths,
                                16 if args.cpu else 128)
        result["times"]["speed_s"] = _since_start()
        s = result["speed"]
        print("decode speed, 32 rows: "
              + ", ".join(f"{p} {v['tokens_per_s']:.0f} tok/s" for p, v in s["paths"].items())
              + f"; auto picks {s['auto']}", flush=True)
        result["ok"] = result["ok"] and not any(v["capture_error"] for v in s["paths"].values())
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


def _agreement_part(result: dict, shape: str, device: str, paths: list[str], new_tokens: int) -> bool:
    """Part 1 into ``result``; whether every path drew the same tokens and the graph was captured."""
    result["agreement"] = agreement(shape, device, paths, new_tokens)
    result["agreement"].update(shape=shape, new_tokens=new_tokens)
    result["times"]["agreement_s"] = _since_start()
    a = result["agreement"]
    print(f"decode check: same tokens {a['same_tokens']}, max log-prob difference "
          f"{max(a['max_logprob_diff'].values()):.2e} ({a['eos_rows']} of {a['rows']} rows end at the EOS)",
          flush=True)
    if a["capture_error"]:
        print(f"decode check FAILED: the CUDA graph could not be captured ({a['capture_error']}); "
              "'cuda_graph' decoded eagerly", flush=True)
    return all(a["same_tokens"].values()) and not a["capture_error"]


if __name__ == "__main__":
    sys.exit(main())
