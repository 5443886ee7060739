"""A micro-batch's forward, loss and backward never make the host wait for the device.

On a GPU the host queues kernels ahead of the device; an operation whose result's size or value the host
must read (a boolean index, ``nonzero``, ``masked_select``, ``unique``, ``.item()``, ``int(tensor)``)
stops it until the device has caught up, CPU and GPU then taking turns. The CPU cannot show a wait, but it
runs the same operations: every one a micro-batch dispatches runs here under a ``TorchDispatchMode`` that
records those that synchronise on CUDA, and the test fails naming each with where it was called. (A copy
between host and device cannot be told from a CPU-to-CPU copy here; the pass makes its copies before the
micro-batches, ``gradients.MicroRows``.)
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_engine import LoRA, MemoryPlan
from grpo_engine.gradients import PolicyGradient
from grpo_engine.losses import CISPO, GSPO, ClippedSurrogate
from tests.test_trainer import make_trainer, sample_with_advantages

aten = torch.ops.aten
# operations whose CUDA kernels read a value or a count back to the host
SYNCHRONISING = {
    aten.nonzero.default, aten.masked_select.default, aten._local_scalar_dense.default,
    aten.is_nonzero.default, aten.equal.default, aten.allclose.default, aten.unique_dim.default,
    aten._unique2.default, aten._unique.default, aten.unique_consecutive.default, aten.masked_scatter.default,
    aten.masked_scatter_.default, aten.repeat_interleave.Tensor, aten.bincount.default,
}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostSyncs(TorchDispatchMode):
    """Records every operation that would synchronise a CUDA device, with the frames of this project that
    called it."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = func in INDEXING and any(
            index is not None and index.dtype == torch.bool for index in args[1])
        if func in SYNCHRONISING or boolean_index:
            where = [f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
                     for frame in traceback.extract_stack()
                     if "/grpo_engine/" in frame.filename or "/transformers/" in frame.filename]
            kind = " (boolean index)" if boolean_index else ""
            self.found.append(f"{func}{kind} at {' < '.join(where[::-1][:3])}")
        return func(*args, **kwargs)


def micro_batch_syncs(trainer, monkeypatch) -> list[str]:
    """Runs one gradient pass of ``trainer`` with each micro-batch under :class:`HostSyncs`."""
    mode = HostSyncs()
    inner = PolicyGradient._micro_step

    def watched(self, *args, **kwargs):
        with mode:
            return inner(self, *args, **kwargs)

    monkeypatch.setattr(PolicyGradient, "_micro_step", watched)
    batch, advantages = sample_with_advantages(trainer)
    ref = trainer.gradients.logprobs(batch, trainer.model, 1.0)  # what a KL loss reads (any [N, C] will do)
    trainer.gradients(batch, advantages, temperature=1.0, old_logprobs=ref - 0.1, ref_logprobs=ref)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())
    return mode.found


def test_the_detector_sees_what_synchronises():
    """The check can fail: a boolean index, nonzero, .item() and int() are each caught."""
    x = torch.arange(6.0)
    with HostSyncs() as mode:
        _ = x[x > 2]
        _ = (x > 2).nonzero()
        _ = x.sum().item()
        _ = int(x.max())
        _ = x.gather(0, torch.tensor([1, 2])) * (x[:2] > 0)  # none: gather on indices, a mask as values
    assert [found.split(" ")[0] for found in mode.found] == [
        "aten.index.Tensor", "aten.nonzero.default", "aten._local_scalar_dense.default",
        "aten._local_scalar_dense.default"]


PLANS = {
    # several vocabulary tiles and chunks, the prompt run once per group
    "tiled, shared prompt": MemoryPlan(micro_batch_size=4, logprob_chunk_size=8, logprob_vocab_tile=32),
    "one tile, one chunk": MemoryPlan(micro_batch_size=8, logprob_chunk_size=4096, logprob_vocab_tile=None),
    "LoRA, checkpointing": MemoryPlan(micro_batch_size=4, lora=LoRA(r=4), gradient_checkpointing=True,
                                      logprob_chunk_size=8, logprob_vocab_tile=32),
    "whole vocabulary chunks": MemoryPlan(micro_batch_size=4, logprob_vocab_tile=None, logprob_chunk_size=8),
}
LOSSES = {
    "grpo + KL": ClippedSurrogate(kl_coef=0.04),
    "dapo": ClippedSurrogate(aggregation="token", clip_eps_high=0.28, mask_truncated=True),
    "dr_grpo": ClippedSurrogate(aggregation="constant", max_completion_tokens=8),
    "gspo": GSPO(), "cispo": CISPO(),
    "tis + delta": ClippedSurrogate(tis_cap=2.0, delta=4.0),
    "entropy bonus": ClippedSurrogate(entropy_coef=0.01),
    "top-entropy tokens": ClippedSurrogate(top_entropy_quantile=0.2),
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_micro_batch_never_waits_for_the_device(tmp_path, monkeypatch, plan):
    trainer = make_trainer(tmp_path, memory=PLANS[plan])
    assert micro_batch_syncs(trainer, monkeypatch) == []


@pytest.mark.parametrize("loss", list(LOSSES))
def test_no_loss_makes_a_micro_batch_wait(tmp_path, monkeypatch, loss):
    trainer = make_trainer(tmp_path, memory=PLANS["tiled, shared prompt"], loss=LOSSES[loss])
    assert micro_batch_syncs(trainer, monkeypatch) == []


def test_a_tied_head_and_its_embedding_write_their_gradient_without_waiting(tmp_path, monkeypatch):
    """Tied embeddings: the head's tiles and the embedding's lookup add into the shared ``.grad``
    (``vocab_tiled.gradients_into_grad``), padding rows included, with gathers and scatters only."""
    trainer = make_trainer(tmp_path, memory=PLANS["tiled, shared prompt"])
    model = trainer.model
    model.get_input_embeddings().padding_idx = 0
    model.lm_head.weight = model.get_input_embeddings().weight
    assert micro_batch_syncs(trainer, monkeypatch) == []


def test_a_micro_batch_without_padding_passes_no_mask_and_gets_the_same_log_probs(tiny_model):
    """No token padded (the host knows it: ``TokenIndex.dense``), the prompt shared: the passes over the
    prompt and the completions get no mask and no positions (transformers' causal path, nothing read back)
    and give the log-probs of the masked pass."""
    from grpo_engine.logprobs import TokenIndex, completion_logprobs

    torch.manual_seed(0)
    prompt = torch.randint(4, 90, (2, 5)).repeat_interleave(3, 0)
    completion = torch.randint(4, 90, (6, 7))
    ones = lambda t: torch.ones_like(t, dtype=torch.bool)  # noqa: E731
    dense = TokenIndex.of(prompt, ones(prompt), ones(completion), share=True)
    assert dense.dense and dense.distinct is not None
    masked = TokenIndex(dense.kept, dense.distinct, dense=False)
    inputs = (tiny_model, prompt, ones(prompt), completion, ones(completion))
    with HostSyncs() as mode:
        got = completion_logprobs(*inputs, index=dense)
    assert mode.found == []
    torch.testing.assert_close(got, completion_logprobs(*inputs, index=masked), rtol=0, atol=1e-5)
