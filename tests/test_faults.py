"""Faults a long run meets, driven end to end: each ends in a clear message, and nothing is lost or
written non-finite (docs/reliability.md lists them)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan
from grpo_engine.guards import NonFiniteError
from grpo_engine.losses import CISPO, GSPO, ClippedSurrogate
from grpo_engine.rewards import Reward
from grpo_engine.types import MicroBatch
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare
from tests.tiny import char_tokenizer, tiny_llama


def trainer_for(tmp_path, rewards=None, max_steps=4, **config):
    tok = char_tokenizer()
    settings = dict(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=max_steps, learning_rate=1e-2,
                    output_dir=str(tmp_path), progress_bar=False)
    return GRPOTrainer(tiny_llama(len(tok)), rewards or [DigitShare()], PROMPTS, GRPOConfig(**{**settings, **config}),
                       MemoryPlan(micro_batch_size=4), tokenizer=tok, template=TEMPLATE)


def weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def finite_files(folder):
    from safetensors.torch import load_file

    files = list(folder.rglob("*.safetensors"))
    return files and all(t.isfinite().all() for f in files for t in load_file(f).values())


# -- non-finite numbers ---------------------------------------------------------------------------


class Huge(Reward):
    """3e38 for completions with a digit: finite in float32, but a group's sum overflows."""

    def score(self, prompt, completion):
        return 3e38 if any(c.isdigit() for c in completion) else 0.0


def test_an_overflowing_reward_skips_the_step_and_stops_the_run_before_any_nan_is_written(tmp_path):
    trainer = trainer_for(tmp_path, rewards=[Huge()], save_every_steps=1)
    before = weights(trainer)
    with pytest.warns(UserWarning, match="skipped, weights unchanged: advantages are not finite"), \
            pytest.raises(NonFiniteError, match=r"3 steps in a row were skipped .* resume from the last checkpoint"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert trainer.state.skipped_steps == 3 and not (tmp_path / "final").exists()
    for checkpoint in tmp_path.glob("checkpoint-*"):  # the skipped steps' checkpoints hold the untouched weights
        assert finite_files(checkpoint)


def test_a_nan_log_prob_skips_the_update_and_names_the_row(tmp_path, monkeypatch):
    import grpo_engine.trainer as trainer_module

    trainer = trainer_for(tmp_path, max_nonfinite_steps=2)
    real = trainer_module.completion_logprobs

    def poisoned(model, *args, **kwargs):  # the training pass's log-prob of one token of the first row is NaN
        out = real(model, *args, **kwargs)
        logprobs = out[0] if isinstance(out, tuple) else out
        if torch.is_grad_enabled():
            logprobs = logprobs.clone()
            logprobs[0, 0] = float("nan")
            return (logprobs, out[1]) if isinstance(out, tuple) else logprobs
        return out

    monkeypatch.setattr(trainer_module, "completion_logprobs", poisoned)
    before = weights(trainer)
    with pytest.warns(UserWarning, match=r"non-finite loss.*the log-probs of rows \[\d+(, \d+)?\] are not finite"):
        metrics = trainer.step()  # the first row trained in each micro-batch of 4
    assert metrics["skipped_steps"] == 1.0 and "grad_norm" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert all(p.grad is None for p in trainer.model.parameters())  # no gradient left for a later step
    monkeypatch.setattr(trainer_module, "completion_logprobs", real)
    assert trainer.step()["skipped_steps"] == 1.0  # a finite step resets the count in a row


def test_non_finite_weights_are_never_saved(tmp_path):
    trainer = trainer_for(tmp_path)
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("inf")
    with pytest.raises(ValueError, match="refusing to save .* hold NaN or inf"):
        trainer.save(tmp_path / "checkpoint-1")
    assert not (tmp_path / "checkpoint-1").exists() and not list(tmp_path.glob(".*"))


def test_an_advantage_of_the_wrong_shape_is_refused(tmp_path):
    tok = char_tokenizer()
    trainer = GRPOTrainer(tiny_llama(len(tok)), [DigitShare()], PROMPTS,
                          GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=8,
                                     output_dir=str(tmp_path), progress_bar=False),
                          tokenizer=tok, template=TEMPLATE, advantage=lambda r, uncertainty=None: r.mean(1))
    with pytest.raises(ValueError, match=r"returned advantages of shape \(2,\); an AdvantageFn maps rewards "
                                         r"\[B, G\]=\(2, 4\) to the same shape"):
        trainer.step()


@pytest.mark.parametrize("loss", [ClippedSurrogate(0.2, 0.28, aggregation="token"), CISPO(), GSPO(level="token")],
                         ids=lambda f: type(f).__name__)
def test_a_huge_log_ratio_gives_the_exact_gradient_not_nan(loss):
    """exp(90) overflows float32. ClippedSurrogate: the ratio of token 1 is clipped (A > 0), so its
    gradient is 0; token 2 is on-policy: -A / 2 tokens = -0.5. Every loss stays finite."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool), advantages=torch.tensor([1.0]),
                       old_logprobs=torch.tensor([[-91.0, -2.0]]))
    out = loss(logprobs, batch, num_valid_tokens=2, num_sequences=1)
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and logprobs.grad.isfinite().all()
    if isinstance(loss, ClippedSurrogate):
        assert logprobs.grad.tolist() == [[0.0, -0.5]]
