"""Base rates: SmolLM2-135M-Instruct's greedy held-out accuracy on reasoning-gym families, untrained.

To pick the families a CPU recipe can learn from: a family the base model never solves gives GRPO no
signal, one it mostly solves leaves little to gain; the goal band is 5% to 50%.

Each family: ``reasoning_gym_task(family, num_train=0, num_test=--items, seed=--seed,
system_prompt=--system-prompt)`` (the family's default configuration; the held-out split the demo's
``--task`` evaluates on, with the demo's ``"direct"`` system prompt), the tokenizer's chat template,
greedy decoding of ``--max-new-tokens`` tokens, scored by ``ReasoningGymScore`` (the family's own
``score_answer`` on reasoning-gym's ``extract_answer``). Reported per family: ``accuracy`` (the share
scoring 1, ``greedy_accuracy``'s rule), ``mean_score`` (partial credit included), ``tagged`` (the share
with an ``<answer>...</answer>`` the extractor finds), ``accuracy_final`` (the same completions scored
with ``ReasoningGymScore(extract="final")``: the last tag, else ``\\boxed{}``, else the last number) and
the seconds it took. Not timed against
anything: the seconds are only to plan a run.

    python benchmarks/task_base_rates.py                       # the 15 default families, 64 items each
    python benchmarks/task_base_rates.py --families gcd lcm --items 16
    python benchmarks/task_base_rates.py --system-prompt none \\
        --instruction " Reply with only the final answer."   # the bare question, no tags asked for
    python benchmarks/task_base_rates.py --families 'gcd:{"max_value": 30}'   # a family's config, as JSON

A family may carry its configuration after a colon, as a JSON object of its config class's fields
(``reasoning_gym.factory.DATASETS[family][1]``); the report's key is the whole text.

Output: ``--out`` (default ``benchmarks/results/task-base-rates.json``), rewritten after each family;
the last stdout line is one JSON object ``{family: accuracy}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _harness import ROOT, git_commit, hardware, say, versions, write_report

FAMILIES = ("basic_arithmetic", "leg_counting", "chain_sum", "simple_equations", "number_sorting",
            "letter_counting", "spell_backward", "word_sorting", "gcd", "lcm", "count_bits",
            "base_conversion", "products", "fraction_simplification", "decimal_arithmetic")
BAND = (0.05, 0.50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--items", type=int, default=64, help="held-out problems per family")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-prompt", default="direct",
                        help="a key of reasoning_gym.utils.SYSTEM_PROMPTS, or none (the bare question)")
    parser.add_argument("--instruction", default="",
                        help="text appended to each question (ChatTemplate(instruction=...)), e.g. "
                             "' Reply with only the final answer.'")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the idle cores)")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "task-base-rates.json")
    args = parser.parse_args()

    import torch
    from reasoning_gym.utils import extract_answer

    from grpo_engine.data.templates import ChatTemplate
    from grpo_engine.demo import idle_cores, smollm2_folder
    from grpo_engine.eval import greedy_accuracy
    from grpo_engine.models import load_model
    from grpo_engine.tasks import ReasoningGymScore, reasoning_gym_task

    torch.set_num_threads(args.threads or idle_cores())
    model, tokenizer = load_model(smollm2_folder())
    reward, final = ReasoningGymScore(), ReasoningGymScore(extract="final")
    template = ChatTemplate(instruction=args.instruction)
    system_prompt = None if args.system_prompt == "none" else args.system_prompt
    report = {"what": "greedy held-out accuracy of SmolLM2-135M-Instruct, no training",
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "band": BAND, "threads": torch.get_num_threads(), "hardware": hardware("cpu"),
              "versions": versions(), "commit": git_commit(), "families": {}}
    for family in args.families:
        start = time.perf_counter()
        name, _, config = family.partition(":")
        _, test = reasoning_gym_task(name, 0, args.items, seed=args.seed, system_prompt=system_prompt,
                                     config=json.loads(config) if config else None)
        result = greedy_accuracy(model, tokenizer, test, reward, template=template,
                                 max_new_tokens=args.max_new_tokens, batch_size=args.items)
        final_scores = final(test, list(result.completions)).tolist()
        report["families"][family] = {
            "accuracy": round(result.accuracy, 4), "mean_score": round(sum(result.scores) / len(test), 4),
            "accuracy_final": round(sum(s >= 1.0 for s in final_scores) / len(test), 4),
            "tagged": round(sum(extract_answer(c) is not None for c in result.completions) / len(test), 4),
            "seconds": round(time.perf_counter() - start, 1), "example": result.completions[0][:120]}
        say("base-rates", f"{family}: {report['families'][family]}")
        write_report(args.out, report)
    for key in ("accuracy", "accuracy_final"):
        report[f"in_band_{key}"] = [f for f, r in report["families"].items() if BAND[0] <= r[key] <= BAND[1]]
    write_report(args.out, report)
    print(f"{'family':<26}{'accuracy':>9}{'mean score':>12}{'tagged':>8}{'final':>8}")
    for family, r in sorted(report["families"].items(), key=lambda item: -item[1]["accuracy_final"]):
        print(f"{family:<26}{r['accuracy']:>9.3f}{r['mean_score']:>12.3f}{r['tagged']:>8.2f}"
              f"{r['accuracy_final']:>8.3f}")
    print(json.dumps({family: r["accuracy"] for family, r in report["families"].items()}))


if __name__ == "__main__":
    main()
