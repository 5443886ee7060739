"""Token-entropy means and the high-entropy ("80/20 forking tokens") mask, alone and in the loss."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from grpo_engine.entropy.token import group_token_entropy, high_entropy_mask, token_entropy_mean
from grpo_engine.losses import ClippedSurrogate
from grpo_engine.ops.tokens import valid_values
from grpo_engine.types import MicroBatch
from tests.test_loss_variants import TRUNCATED, call, inputs, leaf

NAN = math.nan
ONES5 = torch.ones(1, 5, dtype=torch.bool)


# -- means -----------------------------------------------------------------------------------------

def test_token_entropy_mean_weighs_tokens_and_ignores_padding():
    """Row 0: H = 1, 3; row 1: H = 2 (then NaN padding). Token mean (1 + 3 + 2) / 3 = 2, not the
    mean of row means (2 + 2) / 2 (equal here by design), and not 6 / 4 with padding counted."""
    ent = torch.tensor([[1.0, 3.0], [2.0, NAN]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    out = token_entropy_mean(ent, mask)
    assert out.item() == 2.0 and not out.requires_grad
    uneven = token_entropy_mean(torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]]),
                                torch.tensor([[True, True, True], [True, False, False]]))
    assert uneven.item() == pytest.approx(7 / 4)  # a sequence mean would say (1 + 4) / 2 = 2.5
    assert token_entropy_mean(torch.full((2, 2), NAN), torch.zeros(2, 2, dtype=torch.bool)).item() == 0.0


def test_micro_batch_step_shares_sum_to_the_step_mean():
    g = torch.Generator().manual_seed(0)
    ent = 3 * torch.rand(8, 5, generator=g, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 0, 3, 2, 5, 4, 1])[:, None]
    total = int(mask.sum())
    shares = sum(token_entropy_mean(ent[i:i + 3], mask[i:i + 3], num_valid_tokens=total)
                 for i in range(0, 8, 3))
    want = ent[mask].sum().item() / total
    assert shares.item() == pytest.approx(want, abs=1e-12)
    assert token_entropy_mean(ent, mask).item() == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match=r"num_valid_tokens=0 must be >= 1"):
        token_entropy_mean(ent, mask, num_valid_tokens=0)
    with pytest.raises(ValueError, match=r"entropy shape \(8, 5\) must be \[n, C\] and equal the mask shape"):
        token_entropy_mean(ent, mask[:, :4])


def test_group_token_entropy_hand_values():
    """G = 2. Group 0: tokens 1, 1 | 4 -> 6 / 3 = 2. Group 1: 0.5, 0.5 | (none) -> 0.5.
    Group 2: no valid token -> 0."""
    ent = torch.tensor([[1.0, 1.0], [4.0, NAN], [0.5, 0.5], [NAN, NAN], [NAN, 9.0], [NAN, NAN]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0], [0, 0], [0, 0]], dtype=torch.bool)
    out = group_token_entropy(ent, mask, group_size=2)
    torch.testing.assert_close(out, torch.tensor([2.0, 0.5, 0.0]), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"6 rows are not a whole number of groups of group_size=4"):
        group_token_entropy(ent, mask, group_size=4)
    with pytest.raises(ValueError, match=r"group_size=0 must be an int >= 1"):
        group_token_entropy(ent, mask, group_size=0)


# -- the mask --------------------------------------------------------------------------------------

def test_high_entropy_mask_hand_values():
    """Sorted H = 0.1, 0.2, 0.3, 1.5, 2.0; ρ = 0.4 -> quantile 0.6 at rank 0.6·4 = 2.4:
    0.3 + 0.4·(1.5 - 0.3) = 0.78, so 2.0 and 1.5 are kept (2 of 5 = ρ)."""
    ent = torch.tensor([[0.1, 2.0, 0.3, 0.2, 1.5]])
    assert high_entropy_mask(ent, ONES5, 0.4).tolist() == [[False, True, False, False, True]]
    assert high_entropy_mask(ent, ONES5, 1.0).all()  # keep everything
    assert high_entropy_mask(ent, ONES5, 0.0).tolist() == [[False, True, False, False, False]]  # the max only
    # ties at the threshold are all kept; padding never is, whatever it holds
    assert high_entropy_mask(torch.ones(1, 5), ONES5, 0.2).all()
    padded = torch.tensor([[1.0, 2.0, 3.0, 4.0, math.inf], [NAN, 9.0, 0.0, 0.0, 0.0]])
    pmask = torch.tensor([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert high_entropy_mask(padded, pmask, 0.5).tolist() == [[False, False, True, True, False], [False] * 5]
    assert not high_entropy_mask(padded, torch.zeros_like(pmask), 0.5).any()
    with pytest.raises(ValueError, match=r"top_entropy_quantile=1.5 must be in \[0, 1\]"):
        high_entropy_mask(ent, ONES5, 1.5)


def test_high_entropy_mask_takes_the_threshold_over_a_given_pool():
    """The pool adds 5, 6, 7 (another rank's tokens) to H = 0.1, 2.0, 0.3, 0.2, 1.5. ρ = 0.75: rank
    0.25·7 = 1.75 in the sorted 8, 0.2 + 0.75·(0.3 - 0.2) = 0.275, so 0.2 drops; over the 5 alone the
    rank is 0.25·4 = 1, threshold 0.2, and it is kept."""
    ent = torch.tensor([[0.1, 2.0, 0.3, 0.2, 1.5]])
    pool = torch.cat([valid_values(ent, ONES5), torch.tensor([5.0, 6.0, 7.0])])
    assert high_entropy_mask(ent, ONES5, 0.75, among=pool).tolist() == [[False, True, True, False, True]]
    assert high_entropy_mask(ent, ONES5, 0.75).tolist() == [[False, True, True, True, True]]
    assert torch.equal(high_entropy_mask(ent, ONES5, 0.75, among=valid_values(ent, ONES5)),
                       high_entropy_mask(ent, ONES5, 0.75))


def test_the_loss_pools_the_valid_tokens_left_after_its_filters():
    """With ``mask_truncated`` the truncated row's entropies never reach its share of the pool; the
    threshold is the pool's (here: another rank's 4.0 and 5.0 lift it above every local token but 3.0)."""
    fn = ClippedSurrogate(aggregation="token", top_entropy_quantile=0.5, mask_truncated=True)
    assert fn.requires.entropy_pool and not ClippedSurrogate().requires.entropy_pool
    ent = torch.tensor([[1.0, 3.0], [9.0, 9.0], [2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    batch = MicroBatch(mask, torch.ones(3, dtype=torch.float64),
                       is_truncated=torch.tensor([False, True, False]), entropy=ent)
    share = fn.pooled_entropy(batch)
    inf = float("inf")  # a fixed-size share: +inf where no token counts (row 1 truncated, padding)
    assert share.tolist() == [1.0, 3.0, inf, inf, 2.0, inf]
    batch = dataclasses.replace(batch,
                                entropy_pool=torch.cat([share, torch.tensor([4.0, 5.0], dtype=share.dtype)]))
    lp = leaf([[0.0, 0.0]] * 3)
    out = fn(lp, batch, num_valid_tokens=3, num_sequences=2)
    out.loss.backward()
    # pool 1, 2, 3, 4, 5: median 3 -> only H = 3.0 keeps its policy term (-1/3 each kept token)
    torch.testing.assert_close(lp.grad,
                               torch.tensor([[0.0, -1 / 3], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert out.metrics["high_entropy_fraction"].item() == pytest.approx(1 / 3)


class _OneProcess:
    """accelerate with a single process: padding and gathering are identities."""

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def gather(self, x):
        return x


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_high_entropy_mask_equals_trl_and_torch_quantile(quantile, seed):
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    g = torch.Generator().manual_seed(seed)
    ent = 4 * torch.rand(7, 11, generator=g)
    mask = torch.rand(7, 11, generator=g) < 0.7
    mask[3] = False  # an empty row
    ent[~mask] = 0.0  # TRL's padding is finite
    trainer = SimpleNamespace(accelerator=_OneProcess())
    want = trl_grpo.GRPOTrainer.get_high_entropy_mask(trainer, ent, mask.long(), 1 - quantile)
    got = high_entropy_mask(ent, mask, quantile)
    assert torch.equal(got, want)
    threshold = torch.quantile(ent[mask], 1 - quantile)
    assert torch.equal(got, (ent >= threshold) & mask)


# -- in ClippedSurrogate ---------------------------------------------------------------------------

def test_loss_keeps_the_policy_term_of_high_entropy_tokens_only():
    """Token aggregation, on-policy, A = 1, logp = 0: every kept token adds -1/5, the others 0.
    Kept: H = 2.0 and 1.5 (see the hand case above), so loss = -2/5, d loss/d logp = -1/5 there."""
    fn = ClippedSurrogate(aggregation="token", top_entropy_quantile=0.4)
    assert fn.requires.entropy and fn.requires.zero_advantage_rows
    lp, ent = leaf([[0.0] * 5]), leaf([[0.1, 2.0, 0.3, 0.2, 1.5]])
    out = call(fn, lp, ONES5, [1.0], entropy=ent)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.4, abs=1e-12)
    assert lp.grad[0].tolist() == pytest.approx([0.0, -0.2, 0.0, 0.0, -0.2], abs=1e-12)
    assert ent.grad is None or not ent.grad.any()  # the mask is built from detached entropies
    assert out.metrics["high_entropy_fraction"].item() == pytest.approx(0.4)
    assert out.metrics["policy_loss"].item() == pytest.approx(-0.4)


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_gradient_only_on_kept_tokens_and_equal_to_the_full_loss_there(aggregation):
    lp, mask, adv, old, ref, ent = inputs(seed=3)
    kept = high_entropy_mask(ent, mask, 0.3)
    assert 0 < kept.sum() < mask.sum()
    full = ClippedSurrogate(aggregation=aggregation, max_completion_tokens=8, kl_coef=0.0)
    top = ClippedSurrogate(aggregation=aggregation, max_completion_tokens=8, top_entropy_quantile=0.3)
    grads = []
    for fn in (full, top):
        x = lp.detach().clone().requires_grad_()
        call(fn, x, mask, adv, old, entropy=ent.detach()).loss.backward()
        grads.append(x.grad)
    assert not grads[1][~kept].any()
    torch.testing.assert_close(grads[1][kept], grads[0][kept], rtol=0, atol=0)
    # rho = 1 is the full loss
    same = call(ClippedSurrogate(aggregation=aggregation, max_completion_tokens=8, top_entropy_quantile=1.0),
                lp, mask, adv, old, entropy=ent.detach())
    assert torch.equal(same.loss, call(full, lp, mask, adv, old).loss)
    assert same.metrics["high_entropy_fraction"].item() == 1.0


def test_kl_acts_on_every_token_and_clip_fraction_counts_kept_tokens_only():
    """A = 0 removes the policy term: the loss is the KL alone, the same with or without the mask."""
    lp, mask, _, old, ref, ent = inputs(seed=4)
    zero = torch.zeros(mask.shape[0], dtype=torch.float64)
    a = call(ClippedSurrogate(kl_coef=0.1, top_entropy_quantile=0.2), lp, mask, zero, old, ref, entropy=ent)
    b = call(ClippedSurrogate(kl_coef=0.1), lp, mask, zero, old, ref)
    assert torch.equal(a.loss, b.loss)
    adv = torch.ones(mask.shape[0], dtype=torch.float64)
    masked = call(ClippedSurrogate(top_entropy_quantile=0.2), lp, mask, adv, old, entropy=ent).metrics
    plain = call(ClippedSurrogate(), lp, mask, adv, old).metrics
    assert 0 < masked["clip_fraction"] < plain["clip_fraction"]


def test_zero_advantage_rows_move_the_threshold():
    """Row 1 (A = 0) holds the highest entropies. With it, only it passes the 50% quantile, so
    row 0 gets no gradient; without it, row 0's top half is trained. So the rows are needed."""
    fn = ClippedSurrogate(aggregation="token", top_entropy_quantile=0.5)
    mask = torch.ones(2, 2, dtype=torch.bool)
    ent = torch.tensor([[0.1, 0.2], [5.0, 6.0]], dtype=torch.float64)
    with_row = leaf([[0.0, 0.0], [0.0, 0.0]])
    call(fn, with_row, mask, [1.0, 0.0], entropy=ent, counts=(4, 2)).loss.backward()
    without = leaf([[0.0, 0.0]])
    call(fn, without, mask[:1], [1.0], entropy=ent[:1], counts=(4, 2)).loss.backward()
    assert not with_row.grad[0].any() and without.grad[0, 1] == pytest.approx(-0.25)
    assert fn.requires.zero_advantage_rows and not ClippedSurrogate().requires.zero_advantage_rows


def test_validation_and_missing_entropy():
    with pytest.raises(ValueError, match=r"top_entropy_quantile=-0.1 must be in \[0, 1\]"):
        ClippedSurrogate(top_entropy_quantile=-0.1)
    fn = ClippedSurrogate(top_entropy_quantile=0.2)
    with pytest.raises(ValueError, match=r"top_entropy_quantile=0.2 needs batch.entropy \[n, C\]"):
        call(fn, leaf([[0.0]]), [[True]], [1.0])
    with pytest.raises(ValueError, match=r"entropy shape \(1, 2\) must equal logprobs shape \(1, 1\)"):
        call(fn, leaf([[0.0]]), [[True]], [1.0], entropy=torch.zeros(1, 2))
    both = ClippedSurrogate(entropy_coef=0.1, top_entropy_quantile=0.2)
    with pytest.raises(ValueError, match=r"top_entropy_quantile=0.2 and entropy_coef=0.1 "
                                         r"needs batch.entropy"):
        call(both, leaf([[0.0]]), [[True]], [1.0])


@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("aggregation, trl_type, truncated", [
    ("token", "dapo", None), ("sequence", "grpo", None), ("token", "dapo", TRUNCATED)])
def test_loss_and_gradient_equal_trl_with_top_entropy_quantile(monkeypatch, micro_batch_size, aggregation,
                                                               trl_type, truncated):
    """TRL's whole ``_compute_loss`` with ``top_entropy_quantile=0.2`` (its mask per micro-batch),
    against ours micro-batch by micro-batch, KL on (it is not masked on either side)."""
    parity = pytest.importorskip("tests.test_trl_parity")
    trl_grpo = parity.trl_grpo

    class TopQuantile(trl_grpo.GRPOTrainer):  # the parity helper hard-codes 1.0; this property wins
        top_entropy_quantile = property(lambda self: 0.2, lambda self, value: None)

    def clean32(seed=0, **kwargs):  # TRL takes its quantile in float32: use float32-exact entropies
        *rest, ent = clean(seed, **kwargs)
        return (*rest, ent.float().double())

    clean = parity.clean
    monkeypatch.setattr(parity, "clean", clean32)
    monkeypatch.setattr(trl_grpo, "GRPOTrainer", TopQuantile)
    monkeypatch.setattr(parity.SingleProcess, "pad_across_processes", lambda self, x, **_: x, raising=False)
    ours = ClippedSurrogate(0.2, 0.28, 0.1, aggregation, top_entropy_quantile=0.2,
                            mask_truncated=truncated is not None)
    (loss, grad, _), (trl_loss, trl_grad, _) = parity.both(
        ours, trl_type, micro_batch_size, trl_kwargs=dict(epsilon=0.2, epsilon_high=0.28, beta=0.1),
        truncated=truncated, entropy=True)
    torch.testing.assert_close(loss, trl_loss.to(loss.dtype), **parity.TOL)
    torch.testing.assert_close(grad, trl_grad, **parity.TOL)
    plain, _ = parity.both(ClippedSurrogate(0.2, 0.28, 0.1, aggregation,
                                            mask_truncated=truncated is not None),
                           trl_type, micro_batch_size,
                           trl_kwargs=dict(epsilon=0.2, epsilon_high=0.28, beta=0.1),
                           truncated=truncated, entropy=True)
    assert not torch.allclose(plain[1], grad)  # the mask did change the gradient


def test_trainer_passes_entropy_and_logs_the_kept_fraction(tmp_path):
    """One micro-batch holds the whole step, so the kept fraction is that of the step's tokens
    under the trainer's own entropies (at the sampling temperature)."""
    from grpo_engine import MemoryPlan
    from grpo_engine.logprobs import completion_logprobs
    from tests.test_trainer import make_trainer, sample_with_advantages

    trainer = make_trainer(tmp_path, loss=ClippedSurrogate(top_entropy_quantile=0.25), temperature=0.7,
                           memory=MemoryPlan(micro_batch_size=8))
    batch, advantages = sample_with_advantages(trainer)
    metrics = trainer.compute_gradients(batch, advantages)
    with torch.no_grad():
        _, ent = completion_logprobs(trainer.model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                     batch.completion_mask, temperature=0.7, with_entropy=True)
    mask = batch.completion_mask
    kept = high_entropy_mask(ent, mask, 0.25)
    assert metrics["high_entropy_fraction"] == pytest.approx(kept.sum().item() / mask.sum().item(), abs=1e-6)
    assert 0.25 <= metrics["high_entropy_fraction"] < 0.6
