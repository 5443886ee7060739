"""The protocols state everything the trainer reads: components written from their docstrings alone
train, and what they declare (a loss's requirements and counts) is what the trainer does."""

import pytest
import torch

from grpo_engine import GRPOConfig, GRPOTrainer, MemoryPlan, Requirements
from grpo_engine.callbacks import Callback
from grpo_engine.losses import ClippedSurrogate
from grpo_engine.protocols import GroupFilter, GRPOLoss, LossTerm, PromptSource, RewardTransform, Sampler
from grpo_engine.types import LossOutput, MicroBatch, RewardOutput
from tests.test_trainer import PROMPTS, TEMPLATE, DigitShare, grads, sample_with_advantages
from tests.tiny import char_tokenizer, tiny_llama


class Reinforce:
    """The minimal loss of the GRPOLoss docstring, written from it alone."""

    requires = Requirements(zero_advantage_rows=False)

    def counts(self, completion_mask, is_truncated):
        return int(completion_mask.sum()), completion_mask.shape[0]

    def __call__(self, logprobs, batch, *, num_valid_tokens, num_sequences):
        mask = batch.completion_mask
        per_token = -batch.advantages[:, None] * logprobs
        return LossOutput(torch.where(mask, per_token, 0.0).sum() / num_valid_tokens)


def trainer_with(tmp_path, loss, max_steps=2, memory=None, **kw):
    tok = char_tokenizer()
    config = GRPOConfig(prompts_per_step=2, group_size=4, max_completion_tokens=8, max_steps=max_steps,
                        learning_rate=1e-2, output_dir=str(tmp_path), progress_bar=False)
    memory = memory or MemoryPlan(micro_batch_size=3)
    return GRPOTrainer(tiny_llama(len(tok)), [DigitShare()], PROMPTS, config, memory, tokenizer=tok,
                       template=TEMPLATE, loss=loss, **kw)


def test_a_loss_written_from_the_protocol_trains_and_equals_the_on_policy_surrogate(tmp_path):
    """On-policy the ratio is 1, so token-mean REINFORCE has the clipped surrogate's gradient."""
    assert isinstance(Reinforce(), GRPOLoss)
    ours = trainer_with(tmp_path, Reinforce())
    reference = trainer_with(tmp_path, ClippedSurrogate(aggregation="token"))
    assert ours.reference is None and not ours.sampler.return_logprobs  # nothing the loss did not ask for
    batch, advantages = sample_with_advantages(ours)
    ours.compute_gradients(batch, advantages)
    reference.compute_gradients(batch, advantages)
    for a, b in zip(grads(ours), grads(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    metrics = ours.step()
    assert metrics["grad_norm"] > 0 and set(metrics) >= {"loss", "reward/mean", "lr"}


class SquaredDistance:
    """The loss term of the LossTerm docstring, written from it alone: a penalty 0.1 · (logp - ref)²."""

    requires = Requirements(ref_logprobs=True)

    def __call__(self, tokens, batch):
        diff = tokens.logprobs - batch.ref_logprobs
        penalty = torch.where(tokens.mask, 0.1 * diff ** 2, 0.0)
        return tokens.replace(penalty=tokens.penalty + penalty)


def test_a_loss_term_written_from_the_protocol_adds_its_penalty_and_its_needs():
    """Token aggregation, one row, A = 0 (no policy term): logp = [-1, -2], ref = [-1.5, -2], so the
    penalty is 0.1 · [0.25, 0] and the loss their token mean 0.0125; d/dlogp = 0.1 · 2 · [0.5, 0] / 2."""
    assert isinstance(SquaredDistance(), LossTerm)
    loss_fn = ClippedSurrogate(aggregation="token", terms=(SquaredDistance(),))
    assert loss_fn.requires.ref_logprobs and not ClippedSurrogate().requires.ref_logprobs
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    batch = MicroBatch(torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, dtype=torch.float64),
                       ref_logprobs=torch.tensor([[-1.5, -2.0]], dtype=torch.float64))
    out = loss_fn(logp, batch, num_valid_tokens=2, num_sequences=1)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.0125, abs=1e-15)
    assert logp.grad[0].tolist() == pytest.approx([0.05, 0.0], abs=1e-15)
    with pytest.raises(ValueError, match=r"SquaredDistance object at .* needs batch.ref_logprobs \[n, C\], "
                                         r"which is None"):
        loss_fn(logp, MicroBatch(batch.completion_mask, batch.advantages), num_valid_tokens=2,
                num_sequences=1)
    with pytest.raises(ValueError, match="neither a RowFilter .* nor a LossTerm"):
        ClippedSurrogate(terms=("kl",))


def test_a_trainer_computes_what_a_users_loss_term_needs_and_trains_with_it(tmp_path):
    from grpo_engine import LoRA

    lora = MemoryPlan(lora=LoRA(r=4, alpha=8), micro_batch_size=3)
    with_term = trainer_with(tmp_path, ClippedSurrogate(terms=(SquaredDistance(),)), memory=lora)
    plain = trainer_with(tmp_path, ClippedSurrogate(), memory=lora)
    assert with_term.reference is not None and plain.reference is None  # the term's ref_logprobs
    first = with_term.step()  # LoRA starts at the reference: no distance yet
    for name, p in with_term.model.named_parameters():
        dict(plain.model.named_parameters())[name].data.copy_(p.data)  # the same policy for both
    batch, advantages = sample_with_advantages(with_term)
    _, ref = with_term._no_grad_logprobs(batch)
    assert first["grad_norm"] > 0 and ref is not None
    with_term.compute_gradients(batch, advantages, ref_logprobs=ref)
    plain.compute_gradients(batch, advantages)
    assert max(float((a - b).abs().max()) for a, b in zip(grads(with_term), grads(plain))) > 1e-6


def test_what_a_loss_declares_is_what_the_trainer_computes(tmp_path):
    calls = []

    class Declared(Reinforce):
        requires = Requirements(ref_logprobs=True, old_logprobs=True, entropy=True, zero_advantage_rows=True)

        def counts(self, completion_mask, is_truncated):  # leaves the first row out of the step
            return int(completion_mask[1:].sum()), completion_mask.shape[0] - 1

        def __call__(self, logprobs, batch, *, num_valid_tokens, num_sequences):
            calls.append((logprobs.shape[0], batch.ref_logprobs is not None, batch.old_logprobs is not None,
                          batch.entropy is not None, num_sequences))
            return super().__call__(logprobs, batch, num_valid_tokens=num_valid_tokens,
                                    num_sequences=num_sequences)

    trainer = trainer_with(tmp_path, Declared())
    assert trainer.reference is not None
    trainer.step()  # a step computes everything the loss asked for, and passes its counts
    assert all(c[1:] == (True, True, True, 7) for c in calls) and sum(c[0] for c in calls) == 8
    calls.clear()
    batch, advantages = sample_with_advantages(trainer)
    advantages[:4] = 0.0  # a group without signal: still run, since the loss says its rows matter
    trainer.compute_gradients(batch, advantages)
    assert sum(c[0] for c in calls) == 8
    skipping = trainer_with(tmp_path, Reinforce())  # zero_advantage_rows=False: those rows are skipped
    assert skipping.gradients.counted_rows(advantages).tolist() == list(range(4, 8))


def test_the_other_protocols_are_what_their_components_implement(tmp_path):
    from grpo_engine.data import InformativeCurriculum, PromptStream
    from grpo_engine.rewards import KLRewardPenalty
    from grpo_engine.sampling import DynamicSampling, HFSampler

    trainer = trainer_with(tmp_path, None)
    assert isinstance(trainer.sampler, HFSampler) and isinstance(trainer.sampler, Sampler)
    assert (isinstance(PromptStream(PROMPTS, 2), PromptSource)
            and isinstance(InformativeCurriculum(PROMPTS, 2), PromptSource))
    assert isinstance(KLRewardPenalty(0.1), RewardTransform)
    assert isinstance(DynamicSampling(), GroupFilter) and not isinstance(DynamicSampling(), Sampler)


def test_callbacks_see_every_event_in_order_and_can_stop_and_save(tmp_path):
    events = []

    class Recorder(Callback):
        def on_init(self, trainer, state, control):
            events.append("init")

        def on_train_start(self, trainer, state, control):
            events.append("train_start")

        def on_rollout(self, trainer, state, control, *, batch, rewards, uncertainty):
            assert isinstance(rewards, RewardOutput) and batch.num_prompts == 2 and uncertainty is None
            events.append("rollout")

        def on_step_end(self, trainer, state, control, *, metrics):
            events.append(f"step_end {state.step}")
            metrics["custom/seen"] = 1.0
            control.should_save = state.step == 1
            control.should_stop = state.step == 2

        def on_save(self, trainer, state, control, *, path):
            events.append(f"save {path.name}")

        def on_train_end(self, trainer, state, control):
            events.append("train_end")

    trainer = trainer_with(tmp_path, None, max_steps=5, callbacks=[Recorder()])
    history = trainer.train()
    assert events == ["init", "train_start", "rollout", "step_end 1", "save checkpoint-1", "rollout",
                      "step_end 2", "save final", "train_end"]
    assert len(history) == 2 and all(m["custom/seen"] == 1.0 for m in history)  # added metrics are logged
    assert (tmp_path / "checkpoint-1").is_dir()


def test_a_callback_refuses_a_setup_at_construction(tmp_path):
    class NeedsEntropy(Callback):
        def on_init(self, trainer, state, control):
            if trainer.entropy is None:
                raise ValueError("needs an entropy estimator")

    with pytest.raises(ValueError, match="needs an entropy estimator"):
        trainer_with(tmp_path, None, callbacks=[NeedsEntropy()])
