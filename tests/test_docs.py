"""Every Python block of README.md and docs/*.md runs, on the tiny model, so that a renamed argument or
a moved import fails CI instead of a reader.

The blocks of one page run in order in one namespace, as a reader would paste them. What a page
leaves to the reader is supplied: ``model`` (a local folder holding the tiny model and its
tokenizer), ``tokenizer``, ``prompts`` / ``train`` / ``test`` (arithmetic prompts), ``dataset`` (a
``datasets.Dataset``), ``rewards``, ``config``, ``memory``, ``template``, and the names the pages
import elsewhere (``GRPOTrainer``, ``GRPOConfig``, ``MathAccuracy``, ``BoxedFormat``). Hub ids and
``path/to/...`` become the tiny model's folder, ``GRPOTrainer(...,`` the reader's model, rewards and
prompts; hub datasets become a few in-memory rows; a training run stops after its first step.

A block that is not meant to run (a signature list, another library's code) is marked on the line
before it with ``<!-- not run: why -->``; the test counts those too, so a page cannot skip silently.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:step \\d+. every group has identical rewards")

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!-- not run: .+ -->\s*$")
MODEL_ID = re.compile(r"\"(?:Qwen/|HuggingFaceTB/|path/to/)[^\"]*\"")


def blocks(page: str) -> list[tuple[int, str, bool]]:
    """``(line, code, runs)`` for every python block of ``page``."""
    text = (ROOT / page).read_text()
    out = []
    for match in re.finditer(r"```python\n(.*?)^```", text, re.S | re.M):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((text[:match.start()].count("\n") + 1, match.group(1), not NOT_RUN.search(before)))
    return out


def prepare(code: str, folder: Path) -> str:
    code = MODEL_ID.sub(repr(str(folder)), code)
    # the reader's own objects (a page may reuse the name `rewards` for something else)
    return code.replace("GRPOTrainer(...,", "GRPOTrainer(readers_model, readers_rewards, readers_prompts,")


def a_checkpoint(reader: dict) -> None:
    """docs/reliability.md resumes a run: one step saved in the reader's output_dir."""
    from grpo_engine import GRPOTrainer

    GRPOTrainer(reader["model"], reader["rewards"], reader["prompts"], reader["config"]).train()


SETUP = {"docs/reliability.md": a_checkpoint}  # what a page assumes exists before its first block


def _sandbox_missing() -> str | None:
    from grpo_engine.sandbox import sandbox_available

    return sandbox_available()


# what a page's blocks need from the machine (None: there)
NEEDS = {"docs/sandbox.md": _sandbox_missing, "docs/tools.md": _sandbox_missing}


def test_every_page_with_python_is_collected():
    pages = {page for page in PAGES if blocks(page)}
    assert {"README.md", "docs/concepts.md", "docs/rewards.md", "docs/memory.md"} <= pages
    assert "docs/lab/benchmark-history.md" not in PAGES  # the lab notebook is not run


@pytest.fixture
def reader(tiny_folder, tmp_path, monkeypatch):
    """What the pages leave to the reader, in a fresh working directory."""
    import datasets

    import grpo_engine.data as data
    import grpo_engine.trainer as trainer_module
    from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan, Prompt
    from grpo_engine.data import ChatTemplate
    from grpo_engine.models import load_model
    from grpo_engine.rewards import BoxedFormat, MathAccuracy

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    prompts = [Prompt(f"What is {a} + {b}?", str(a + b)) for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    (tmp_path / "data").mkdir()
    for name in ("train", "test"):
        (tmp_path / "data" / f"{name}.jsonl").write_text(
            "".join(json.dumps({"question": p.question, "answer": p.target}) + "\n" for p in prompts))
    rows = {"prompt": [p.question for p in prompts], "answer": [p.target for p in prompts]}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict(rows))
    monkeypatch.setattr(data, "load_gsm8k", lambda path=None, *, split="train", limit=None: prompts[:limit])
    monkeypatch.setattr(trainer_module, "run_finished", lambda config, state: state.step >= 1)
    _, tokenizer = load_model(str(tiny_folder))
    return {
        "model": str(tiny_folder), "tokenizer": tokenizer, "prompts": prompts, "train": prompts,
        "test": prompts, "dataset": datasets.Dataset.from_dict(rows), "rewards": [MathAccuracy()],
        "config": GRPOConfig(prompts_per_step=2, group_size=2, max_completion_tokens=8, max_steps=1,
                             output_dir="runs/reader"),
        "memory": MemoryPlan(), "template": ChatTemplate(), "GRPOTrainer": GRPOTrainer,
        "GRPOConfig": GRPOConfig, "MathAccuracy": MathAccuracy, "BoxedFormat": BoxedFormat,
        "readers_model": str(tiny_folder), "readers_rewards": [MathAccuracy()], "readers_prompts": prompts,
    }


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_the_python_blocks_of_each_page_run(page, reader, tiny_folder):
    missing = NEEDS[page]() if page in NEEDS else None
    if missing:
        pytest.skip(f"{page} needs what this machine lacks: {missing}")
    if page in SETUP:
        SETUP[page](reader)
    namespace = {"__name__": "__docs__", **reader}
    ran = skipped = 0
    for line, code, runs in blocks(page):
        if not runs:
            skipped += 1
            continue
        try:
            exec(compile(prepare(code, tiny_folder), f"{page}:{line}", "exec"), namespace)
        except Exception as error:
            why = f"{type(error).__name__}: {error}"
            raise AssertionError(f"the block at {page}:{line} fails: {why}") from error
        ran += 1
    assert ran >= 1, f"{page}: every block is marked not run ({skipped})"
