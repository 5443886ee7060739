"""Our losses against TRL's ``GRPOTrainer._compute_loss`` on identical tensors.

TRL computes its loss inside a trainer method. We build the trainer with ``object.__new__``
(no model, no dataset), set exactly the attributes ``_compute_loss`` reads, and replace the
forward pass (``_get_per_token_logps_and_entropies``) by one that returns our tensors. The
accelerator is a single-process stand-in whose collectives are identities (what
``accelerate`` does with one process). Where the definitions agree, loss and gradient must
agree to 1e-6 (micro-batch by micro-batch, TRL's gradient-accumulation scaling included);
where they differ, the test pins down the exact difference documented in the loss modules.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_engine.losses import CISPO, GSPO, ClippedSurrogate
from tests.test_loss_variants import MAX_LEN, TRUNCATED, call, inputs

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

TOL = dict(rtol=1e-6, atol=1e-6)


class SingleProcess:
    """accelerate's collectives with one process: identities."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(loss_type, lp, mask, adv, old=None, ref=None, *, epsilon=0.2, epsilon_high=None, beta=0.0,
             delta=None, level="token", accumulation=1, num_items=None, entropies=None, entropy_coef=0.0,
             bias_correction_kl=False, metrics=None):
    """TRL's loss for one micro-batch. ``lp``/``old``/``ref`` must be finite on padding (as
    TRL's are). ``accumulation`` is gradient_accumulation_steps = steps_per_generation;
    ``num_items`` the token count of the whole generation batch (TRL's num_items_in_batch)."""
    trainer = object.__new__(trl_grpo.GRPOTrainer)
    mask = torch.as_tensor(mask).long()
    n, width = mask.shape
    entropies = torch.zeros(n, width, dtype=lp.dtype) if entropies is None else entropies
    vars(trainer).update(
        loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, aux_loss_enabled=False, use_vllm=False,
        vllm_importance_sampling_correction=False, max_completion_length=MAX_LEN,
        current_gradient_accumulation_steps=accumulation, accelerator=SingleProcess(),
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        entropy_coef=entropy_coef, _entropy_bonus_enabled=entropy_coef != 0.0, use_adaptive_entropy=False,
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=bias_correction_kl,
                             steps_per_generation=accumulation),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (lp, entropies, None),
    )
    batch = dict(
        prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
        completion_ids=torch.zeros(n, width, dtype=torch.long), completion_mask=mask,
        advantages=torch.as_tensor(adv, dtype=lp.dtype), old_per_token_logps=old, ref_per_token_logps=ref,
        num_items_in_batch=torch.tensor(int(mask.sum()) if num_items is None else num_items),
    )
    loss = trainer._compute_loss(None, batch)
    if metrics is not None:
        metrics.update(trainer._metrics["train"])
    return loss


def clean(seed=0, **kwargs):
    """inputs() with TRL-style finite padding (0) in log-probs and entropies."""
    lp, mask, adv, old, ref, ent = inputs(seed=seed, **kwargs)
    zero = torch.zeros((), dtype=lp.dtype)
    return (torch.where(mask, lp.detach(), zero), mask, adv, torch.where(mask, old, zero),
            torch.where(mask, ref, zero), torch.where(mask, ent.detach(), zero))


def both(ours, trl_type, micro_batch_size=8, *, seed=0, trl_kwargs=None, truncated=None, entropy=False):
    """Loss and gradient (wrt log-probs, and entropies when used) of ours and of TRL, summed
    over micro-batches of ``micro_batch_size`` rows (TRL: accumulation steps = 8 / size)."""
    lp, mask, adv, old, ref, ent = clean(seed)
    trunc = None if truncated is None else torch.tensor(truncated)
    counts = ours.counts(mask, trunc)
    trl_mask = mask if trunc is None else mask & ~trunc[:, None]  # TRL's mask_truncated_completions
    accumulation = 8 // micro_batch_size
    results = []
    for side in ("ours", "trl"):
        x, h = lp.clone().requires_grad_(), ent.clone().requires_grad_()
        total = 0
        for s in (slice(i, i + micro_batch_size) for i in range(0, 8, micro_batch_size)):
            if side == "ours":
                total = total + call(ours, x[s], mask[s], adv[s], old[s], ref[s], counts=counts,
                                     truncated=None if trunc is None else trunc[s],
                                     entropy=h[s] if entropy else None).loss
            else:
                total = total + trl_loss(trl_type, x[s], trl_mask[s], adv[s], old[s], ref[s],
                                         accumulation=accumulation, num_items=int(trl_mask.sum()),
                                         entropies=h[s], **(trl_kwargs or {}))
        total.backward()
        results.append((total.detach(), x.grad, h.grad if entropy else None))
    return results


# -- where the definitions agree -----------------------------------------------------------------

CLIP = dict(epsilon=0.2, epsilon_high=0.28)
KL = dict(beta=0.1)  # TRL's k3, with use_bias_correction_kl=False (see the test further down)


@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("ours, trl_type, trl_kwargs", [
    (ClippedSurrogate(0.2, 0.28, aggregation="sequence"), "grpo", CLIP),
    (ClippedSurrogate(0.2, 0.28, 0.1, "sequence", delta=1.5), "grpo", dict(**CLIP, **KL, delta=1.5)),
    (ClippedSurrogate(0.2, 0.28, aggregation="token"), "dapo", CLIP),
    (ClippedSurrogate(0.2, 0.28, 0.1, "token", delta=1.5), "dapo", dict(**CLIP, **KL, delta=1.5)),
    (ClippedSurrogate(0.2, 0.28, 0.1, "constant", MAX_LEN), "dr_grpo", dict(**CLIP, **KL)),
    (GSPO(3e-4, 4e-4), "grpo", dict(epsilon=3e-4, epsilon_high=4e-4, level="sequence")),
    (GSPO(0.1, 0.15, 0.1), "grpo", dict(epsilon=0.1, epsilon_high=0.15, level="sequence", **KL)),
    (GSPO(0.1, 0.15, 0.1, level="token"), "grpo",
     dict(epsilon=0.1, epsilon_high=0.15, level="sequence", **KL)),
    (CISPO(None, 0.3), "cispo", dict(epsilon_high=1.3)),
    (CISPO(None, 4.0, 0.1), "cispo", dict(epsilon_high=5.0, **KL)),
], ids=str)
def test_equal_loss_and_gradient(ours, trl_type, trl_kwargs, micro_batch_size):
    (loss, grad, _), (trl_value, trl_grad, _) = both(ours, trl_type, micro_batch_size, trl_kwargs=trl_kwargs)
    torch.testing.assert_close(loss, trl_value, **TOL)
    torch.testing.assert_close(grad, trl_grad, **TOL)
    assert grad.abs().sum() > 0


def test_bnpo_equals_token_aggregation_with_one_micro_batch():
    (loss, grad, _), (trl_value, trl_grad, _) = both(ClippedSurrogate(aggregation="token"), "bnpo")
    torch.testing.assert_close(loss, trl_value, **TOL)
    torch.testing.assert_close(grad, trl_grad, **TOL)


def test_mask_truncated_equals_trl_dapo():
    ours = ClippedSurrogate(0.2, 0.28, aggregation="token", mask_truncated=True)
    for size in (8, 2):
        (loss, grad, _), (trl_value, trl_grad, _) = both(ours, "dapo", size, trl_kwargs=CLIP,
                                                         truncated=TRUNCATED)
        torch.testing.assert_close(loss, trl_value, **TOL)
        torch.testing.assert_close(grad, trl_grad, **TOL)


def test_entropy_bonus_equals_trl_for_token_aggregation():
    ours = ClippedSurrogate(aggregation="token", entropy_coef=0.05)
    (loss, grad, h_grad), (trl_value, trl_grad, trl_h_grad) = both(
        ours, "dapo", trl_kwargs=dict(entropy_coef=0.05), entropy=True)
    torch.testing.assert_close(loss, trl_value, **TOL)
    torch.testing.assert_close(grad, trl_grad, **TOL)
    torch.testing.assert_close(h_grad, trl_h_grad, **TOL)


# -- where they differ: the exact difference ------------------------------------------------------

def test_bnpo_normalises_by_the_micro_batch_token_count():
    """TRL bnpo, micro-batches of 2: each micro loss is Σ_local ℓ / (local tokens · 4), ours
    Σ_local ℓ / step tokens; so TRL's micro loss = ours · nvt / (local tokens · 4)."""
    lp, mask, adv, old, ref, _ = clean()
    fn = ClippedSurrogate(aggregation="token")
    nvt = int(mask.sum())
    trl_total = ours_total = 0.0
    for s in (slice(i, i + 2) for i in range(0, 8, 2)):
        ours = call(fn, lp[s], mask[s], adv[s], old[s], ref[s], counts=(nvt, 8)).loss
        trl = trl_loss("bnpo", lp[s], mask[s], adv[s], old[s], ref[s], accumulation=4)
        local = max(int(mask[s].sum()), 1)
        torch.testing.assert_close(trl, ours * nvt / (local * 4), **TOL)
        trl_total, ours_total = trl_total + trl, ours_total + ours
    assert abs(trl_total - ours_total) > 1e-3  # unequal token counts per micro-batch


def test_mask_truncated_sequence_mean_divides_by_kept_rows_trl_by_all_rows():
    """TRL grpo with mask_truncated_completions divides by all 8 rows, ours by the 6 kept."""
    ours = ClippedSurrogate(0.2, 0.28, aggregation="sequence", mask_truncated=True)
    (loss, grad, _), (trl_value, trl_grad, _) = both(ours, "grpo", trl_kwargs=CLIP, truncated=TRUNCATED)
    kept = TRUNCATED.count(False)
    torch.testing.assert_close(trl_value, loss * kept / 8, **TOL)
    torch.testing.assert_close(trl_grad, grad * kept / 8, **TOL)


def test_entropy_bonus_sequence_aggregation_differs_from_trl_token_mean():
    """TRL's bonus is always coef · token mean of H; ours aggregates H like the loss."""
    coef = 0.05
    ours = ClippedSurrogate(aggregation="sequence", entropy_coef=coef)
    (loss, _, h_grad), (trl_value, _, trl_h_grad) = both(ours, "grpo", trl_kwargs=dict(entropy_coef=coef),
                                                          entropy=True)
    _, mask, _, _, _, ent = clean()
    lengths = mask.sum(1).clamp(min=1).double()
    seq_mean = (ent * mask).sum(1).div(lengths).sum() / 8
    token_mean = (ent * mask).sum() / mask.sum()
    torch.testing.assert_close(trl_value - loss, coef * (seq_mean - token_mean), **TOL)
    torch.testing.assert_close(trl_h_grad, torch.where(mask, -coef / mask.sum(), 0.0).double(), **TOL)
    torch.testing.assert_close(h_grad, torch.where(mask, -coef / (8 * lengths[:, None]), 0.0), **TOL)


def test_trl_bias_corrected_kl_differs_in_gradient_even_on_policy():
    """TRL's default use_bias_correction_kl=True multiplies k3 by the ratio. On-policy the ratio
    is 1, so values agree, but d(ratio·k3) = k3 + k3' adds β·k3·(aggregation weight) per token."""
    lp, mask, adv, _, ref, _ = clean()
    fn = ClippedSurrogate(aggregation="token", kl_coef=0.1)
    x1, x2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    ours = call(fn, x1, mask, adv, None, ref).loss
    trl = trl_loss("dapo", x2, mask, adv, None, ref, beta=0.1, bias_correction_kl=True)
    ours.backward()
    trl.backward()
    torch.testing.assert_close(trl, ours, **TOL)
    k3 = torch.where(mask, torch.expm1(ref - lp) - (ref - lp), 0.0)
    torch.testing.assert_close(x2.grad - x1.grad, 0.1 * k3 / mask.sum(), **TOL)
    assert (x2.grad - x1.grad).abs().max() > 1e-4


def test_gspo_with_token_summing_trl_losses_weights_sequences_by_length():
    """TRL dapo + importance_sampling_level="sequence" gives Σ_i |o_i| ℓ_i / Σ|o_i|; ours (and
    TRL grpo) gives Σ_i ℓ_i / num_sequences, with ℓ_i = -min(s_i A_i, clip(s_i) A_i)."""
    lp, mask, adv, old, ref, _ = clean()
    lengths = mask.sum(1).double()
    s = torch.exp(((lp - old) * mask).sum(1) / lengths.clamp(min=1))
    seq_loss = torch.where(lengths > 0, -torch.minimum(s * adv, s.clamp(0.9, 1.15) * adv), 0.0)
    trl = trl_loss("dapo", lp, mask, adv, old, ref, epsilon=0.1, epsilon_high=0.15, level="sequence")
    ours = call(GSPO(0.1, 0.15), lp, mask, adv, old, ref).loss
    torch.testing.assert_close(trl, (lengths * seq_loss).sum() / lengths.sum(), **TOL)
    torch.testing.assert_close(ours, seq_loss.sum() / 8, **TOL)
    assert abs(trl - ours) > 1e-3


def test_cispo_clip_metric_counts_both_signs_trl_only_positive_advantages():
    lp, mask, adv, old, ref, _ = clean()
    out = call(CISPO(None, 0.3), lp, mask, adv, old, ref)
    metrics = {}
    trl_loss("cispo", lp, mask, adv, old, ref, epsilon_high=1.3, metrics=metrics)
    ratio = torch.exp(lp - old)
    over = (ratio > 1.3) & mask
    nvt = mask.sum()
    assert out.metrics["clip_fraction"].item() == pytest.approx(
        ((over & (adv != 0)[:, None]).sum() / nvt).item())
    assert metrics["cispo_clip_ratio"][0] == pytest.approx(((over & (adv > 0)[:, None]).sum() / nvt).item())
    assert out.metrics["clip_fraction"].item() > metrics["cispo_clip_ratio"][0]
