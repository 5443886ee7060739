"""Exact resume and durable saves: a run killed after a checkpoint, or in the middle of one, resumes
to the same metrics and the same final weights, bit for bit, as a run never interrupted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_engine import GRPOConfig, GRPOTrainer, LoRA, MemoryPlan
from grpo_engine.checkpoint import Resume, clean_leftovers, latest_checkpoint, prune_checkpoints
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare
from tests.tiny import char_tokenizer, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_resume_run.py"


def run(out: Path, max_steps: int, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), str(max_steps), *flags],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def metrics(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith("time/") and k != "tokens/generated_per_s"}
            for line in lines]


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    proc = run(out, 6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("kill", ["--kill-after", "--kill-in-save"])
def test_a_killed_run_resumes_bit_for_bit(uninterrupted, tmp_path, kill):
    out = tmp_path / "run"
    proc = run(out, 6, kill, "4")
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL
    # checkpoint-4 never arrived: its temporary folder is left, checkpoint-2 is whole
    if kill == "--kill-in-save":
        assert not (out / "checkpoint-4").exists() and list(out.glob(".tmp-checkpoint-4-*"))
        assert latest_checkpoint(out).name == "checkpoint-2"
    else:
        assert latest_checkpoint(out).name == "checkpoint-4"
    proc = run(out, 6, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(out.glob(".tmp-*")) and not list(out.glob(".old-*"))  # leftovers cleaned
    assert metrics(out) == metrics(uninterrupted)  # every step once (the killed run's extra lines dropped)
    for name in ("final", "checkpoint-6"):
        ours, whole = adapter(out / name), adapter(uninterrupted / name)
        assert ours.keys() == whole.keys() and all(torch.equal(ours[k], whole[k]) for k in ours)


def trainer_at(out: Path, resume_from=None, callbacks=(), **changes):
    tok = char_tokenizer()
    settings = dict(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=4,
                    learning_rate=5e-2, save_every_steps=2, output_dir=str(out), progress_bar=False, seed=3)
    memory = changes.pop("memory", MemoryPlan(lora=LoRA(r=4, alpha=8), micro_batch_size=4))
    return GRPOTrainer(tiny_llama(len(tok), seed=3), [DigitShare()], PROMPTS,
                       GRPOConfig(**{**settings, **changes}), memory, tokenizer=tok, template=TEMPLATE,
                       callbacks=callbacks, resume_from=resume_from)


def test_a_changed_setting_is_refused_by_name_and_a_safe_one_can_be_allowed(tmp_path):
    trainer_at(tmp_path).train()
    with pytest.raises(ValueError, match=r"config.learning_rate was 0.05, now 0.1: "
                                         r"it changes the run's math"):
        trainer_at(tmp_path, "latest", learning_rate=0.1)
    with pytest.raises(ValueError, match=r"config.max_steps was 4, now 6: allow it with Resume\(path, "
                                         r"allow_changes=\{'config.max_steps'\}\) \(CLI: --allow-change"):
        trainer_at(tmp_path, "latest", max_steps=6)
    with pytest.raises(ValueError, match=r"memory.lora was .* it changes the run's math"):
        trainer_at(tmp_path, "latest", memory=MemoryPlan(lora=LoRA(r=8, alpha=8), micro_batch_size=4))
    resumed = trainer_at(tmp_path, Resume("latest", allow_changes={"config.max_steps"}), max_steps=6)
    assert resumed.resumed_from.name == "final" and resumed.step_count == 4
    history = resumed.train()
    assert [m["lr"] for m in history] and resumed.step_count == 6
    with pytest.raises(ValueError, match=r"cannot change on resume"):
        Resume("latest", allow_changes={"config.learning_rate"})


def test_resume_needs_a_checkpoint_and_a_used_folder_needs_resume(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trainer checkpoint in"):
        trainer_at(tmp_path, "latest")
    trainer_at(tmp_path, max_steps=2).train()
    with pytest.raises(FileExistsError, match=r"resume_from='latest'\) \(CLI: --resume\)"):
        trainer_at(tmp_path, max_steps=2).train()


def test_keep_last_prunes_old_checkpoints_but_never_final(tmp_path):
    trainer_at(tmp_path, max_steps=6, keep_last_checkpoints=2).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert (tmp_path / "final").is_dir() and prune_checkpoints(tmp_path, 1) == [tmp_path / "checkpoint-4"]


def test_leftovers_of_an_interrupted_save_are_cleaned_or_restored(tmp_path):
    (tmp_path / ".tmp-checkpoint-8-0123abcd").mkdir()
    (tmp_path / ".old-final-89abcdef").mkdir()  # a save died between its two renames: final/ is missing
    (tmp_path / ".old-final-89abcdef" / "x").write_text("the previous final")
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / ".old-checkpoint-2-00000000").mkdir()  # its replacement arrived: the old copy goes
    done = clean_leftovers(tmp_path)
    assert (tmp_path / "final" / "x").read_text() == "the previous final"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "final"] and len(done) == 3


def test_a_save_replaces_a_folder_whole(tmp_path, monkeypatch):
    import grpo_engine.checkpoint as checkpoint

    trainer = trainer_at(tmp_path)
    first = trainer.save(tmp_path / "final")
    (first / "marker").write_text("old")
    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)  # the fallback: rename aside, then in
    trainer.save(tmp_path / "final")
    assert (not (tmp_path / "final" / "marker").exists()
            and not [p for p in tmp_path.iterdir() if p.name[0] == "."])


def test_a_format_1_checkpoint_resumes_like_the_one_it_became(tmp_path):
    """A checkpoint written before the trainer's counters moved under ``"trainer"`` (format 1: the step,
    clock, temperature and skipped steps in the summary, the counts in a row and the warning beside the
    state) resumes to the same state and the same next step as today's format."""
    trainer_at(tmp_path / "run", max_steps=2).train()
    new = tmp_path / "run" / "checkpoint-2"
    old = tmp_path / "old" / "checkpoint-2"
    old.parent.mkdir()
    import shutil

    shutil.copytree(new, old)
    state = torch.load(old / "trainer_state.pt", weights_only=False)
    counters = state.pop("trainer")
    state["skipped_in_a_row"], state["warned_zero_std"] = counters["skipped_in_a_row"], True
    torch.save(state, old / "trainer_state.pt")
    summary = json.loads((old / "trainer_state.json").read_text())
    (old / "trainer_state.json").write_text(json.dumps({**summary, "format": 1}))
    steps = []
    for folder, allowed in ((old, {"config.max_steps", "config.output_dir"}), (new, {"config.max_steps"})):
        trainer = trainer_at(folder.parent, resume_from=Resume(folder, frozenset(allowed)), max_steps=3)
        steps.append((trainer.state.step, trainer.state.train_seconds, trainer.step()["grad_norm"]))
        assert trainer.state.zero_std_warned == (folder == old)
    assert steps[0] == steps[1] and steps[0][0] == 2 and steps[0][1] > 0  # the same third step


def test_a_checkpoint_older_than_a_setting_resumes_when_the_setting_is_at_its_default(tmp_path):
    """A checkpoint saved before ``max_turns`` existed (its description lacks it) resumes at the default,
    which is what that run did, and is refused with another value."""
    trainer_at(tmp_path, max_steps=2).train()
    summary_file = tmp_path / "checkpoint-2" / "trainer_state.json"
    summary = json.loads(summary_file.read_text())
    del summary["settings"]["config.max_turns"]
    summary_file.write_text(json.dumps(summary))
    resumed = trainer_at(tmp_path, Resume(tmp_path / "checkpoint-2", frozenset({"config.max_steps"})),
                         max_steps=3)
    assert resumed.state.step == 2
    with pytest.raises(ValueError, match=r"config.max_turns was None, now 2"):
        trainer_at(tmp_path, Resume(tmp_path / "checkpoint-2", frozenset({"config.max_steps"})), max_steps=3,
                   max_turns=2)
