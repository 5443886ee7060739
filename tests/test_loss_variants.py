"""Numbers for GSPO, CISPO and ClippedSurrogate's newer options (delta, kl_estimator,
mask_truncated, entropy bonus, counts)."""

import dataclasses
import math

import pytest
import torch

from grpo_engine.losses import CISPO, GSPO, KL_ESTIMATORS, ClippedSurrogate, kl_estimator, kl_k1, kl_k2, kl_k3
from grpo_engine.protocols import GRPOLoss
from grpo_engine.types import MicroBatch

E = math.exp
MAX_LEN = 8
AGGS = ("sequence", "token", "constant")
TRUNCATED = (False, True, False, False, True, False, False, False)

def call(fn, lp, mask, adv, old=None, ref=None, *, truncated=None, entropy=None, counts=None):
    """Runs ``fn`` on one micro-batch; ``counts`` default to ``fn.counts`` of this batch."""
    mask = torch.as_tensor(mask, dtype=torch.bool)
    trunc = None if truncated is None else torch.as_tensor(truncated, dtype=torch.bool)
    batch = MicroBatch(mask, torch.as_tensor(adv, dtype=torch.float64), old, ref, trunc, entropy=entropy)
    nvt, ns = fn.counts(mask, trunc) if counts is None else counts
    return fn(lp, batch, num_valid_tokens=nvt, num_sequences=ns)


def leaf(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype).requires_grad_()


def inputs(seed=0, lengths=(6, 1, 3, 0, 2, 6, 4, 1), width=6, dtype=torch.float64):
    """Mixed lengths (one-token rows, an empty row), a zero-advantage group (rows 4-7, all
    rewards equal), garbage on padding; returns lp, mask, adv, old, ref, entropy."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    lp = -3 * torch.rand(n, width, generator=g, dtype=torch.float64)
    old = lp + 0.4 * torch.randn(n, width, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(n, width, generator=g, dtype=torch.float64)
    ent = 2 * torch.rand(n, width, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[4:] = 0.0
    lp[~mask], old[~mask], ref[~mask], ent[~mask] = math.nan, math.inf, -math.inf, math.nan
    return (lp.to(dtype).requires_grad_(), mask, adv, old.to(dtype), ref.to(dtype),
            ent.to(dtype).requires_grad_())


def k_value_grad(name, lp, ref):
    """Per-token KL estimator value and d/dlogp, from Schulman's formulas (x = log ρ)."""
    x = ref - lp
    return {"k1": (-x, 1.0), "k2": (0.5 * x * x, -x), "k3": (E(x) - x - 1, 1 - E(x))}[name]


def lists(*tensors):
    return [t.detach().double().tolist() for t in tensors]


def gspo_reference(lp, old, ref, adv, mask, *, eps_low, eps_high, kl_coef, est, nvt, ns):
    """Naive fp64 loop from GSPO eqs. 5-7: s_i = exp(mean_t log w), sequence clip, mean over i."""
    lp, old, ref, adv, mask = lists(lp, old, ref, adv, mask)
    out = dict(loss=0.0, policy_loss=0.0, clip_fraction=0.0, kl=0.0)
    grad = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, keep in enumerate(row) if keep]
        if not idx:
            continue
        s = E(sum(lp[i][t] - old[i][t] for t in idx) / len(idx))
        c = min(max(s, 1 - eps_low), 1 + eps_high)
        clipped = c * adv[i] < s * adv[i]
        out["loss"] -= min(s * adv[i], c * adv[i]) / ns
        out["policy_loss"] -= min(s * adv[i], c * adv[i]) / ns
        out["clip_fraction"] += clipped / ns
        for t in idx:
            k, dk = k_value_grad(est, lp[i][t], ref[i][t])
            out["loss"] += kl_coef * k / (len(idx) * ns)
            out["kl"] += k / nvt
            grad[i][t] = (0.0 if clipped else -adv[i] * s / len(idx)) / ns + kl_coef * dk / (len(idx) * ns)
    return out, torch.tensor(grad, dtype=torch.float64)


def cispo_reference(lp, old, ref, adv, mask, *, eps_low, eps_high, kl_coef, est, nvt):
    """Naive fp64 loop from MiniMax-M1 eqs. 4-5: -sg(clip(w)) A log π, token mean."""
    lp, old, ref, adv, mask = lists(lp, old, ref, adv, mask)
    out = dict(loss=0.0, policy_loss=0.0, clip_fraction=0.0, kl=0.0)
    grad = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        for t, keep in enumerate(row):
            if not keep:
                continue
            r = E(lp[i][t] - old[i][t])
            w = min(r, 1 + eps_high) if eps_low is None else min(max(r, 1 - eps_low), 1 + eps_high)
            k, dk = k_value_grad(est, lp[i][t], ref[i][t])
            out["loss"] += (-w * adv[i] * lp[i][t] + kl_coef * k) / nvt
            out["policy_loss"] += -w * adv[i] * lp[i][t] / nvt
            out["clip_fraction"] += (w != r and adv[i] != 0) / nvt
            out["kl"] += k / nvt
            grad[i][t] = (-w * adv[i] + kl_coef * dk) / nvt
    return out, torch.tensor(grad, dtype=torch.float64)


def assert_matches(out, lp, want, grad, kl_coef, tol):
    out.loss.backward()
    assert out.loss.item() == pytest.approx(want.pop("loss"), rel=tol, abs=tol)
    if not kl_coef:
        assert "kl" not in out.metrics
        want.pop("kl")
    for name, value in want.items():
        assert out.metrics[name].item() == pytest.approx(value, rel=tol, abs=tol), name
        assert not out.metrics[name].requires_grad
    torch.testing.assert_close(lp.grad.double(), grad, rtol=tol, atol=tol)


# -- GSPO ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("level", ["sequence", "token"])
def test_gspo_hand_values(level):
    """ε = 0.2, old = 0, two sequences (ns = 2).
    Row 0: logp [0.5, 0.3] -> s = e^0.4 ≈ 1.4918 > 1.2, A=+1 -> ℓ = -1.2, clipped, no gradient.
    Row 1: logp [-0.1] -> s = e^-0.1 ≈ 0.9048 in [0.8, 1.2], A=-1 -> ℓ = 0.9048, gradient
    -A·s/|o|/ns = 0.4524. loss (-1.2 + 0.9048)/2 = -0.14758, clip_fraction 1/2."""
    lp = leaf([[0.5, 0.3], [-0.1, math.nan]])
    out = call(GSPO(0.2, 0.2, level=level), lp, [[1, 1], [1, 0]], [1.0, -1.0], torch.zeros(2, 2))
    out.loss.backward()
    assert out.loss.item() == pytest.approx((-1.2 + E(-0.1)) / 2, abs=1e-12)
    assert out.loss.item() == pytest.approx(-0.14758, abs=1e-5)
    assert out.metrics["clip_fraction"].item() == 0.5
    torch.testing.assert_close(lp.grad, torch.tensor([[0, 0], [E(-0.1) / 2, 0]], dtype=torch.float64))


def test_gspo_clips_sequences_not_tokens():
    """logp [0.5, -0.5], old 0, A=+1, ε = 0.2. Token ratios e^±0.5 = [1.6487, 0.6065] but
    s = e^0 = 1: GSPO keeps the sequence (loss -1, gradient -s/|o| = [-0.5, -0.5]); the token
    surrogate clips token 0 (loss -(1.2 + 0.6065)/2 = -0.90327, gradient [0, -0.30327])."""
    lp = leaf([[0.5, -0.5]])
    out = call(GSPO(0.2, 0.2), lp, [[1, 1]], [1.0], torch.zeros(1, 2))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0, abs=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, -0.5]], dtype=torch.float64))
    lp2 = leaf([[0.5, -0.5]])
    tok = call(ClippedSurrogate(0.2), lp2, [[1, 1]], [1.0], torch.zeros(1, 2))
    tok.loss.backward()
    assert tok.loss.item() == pytest.approx(-(1.2 + E(-0.5)) / 2, abs=1e-12)
    torch.testing.assert_close(lp2.grad, torch.tensor([[0.0, -E(-0.5) / 2]], dtype=torch.float64))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kl_coef, est", [(0.0, "k3"), (0.1, "k3"), (0.1, "k2"), (0.1, "k1")])
@pytest.mark.parametrize("level", ["sequence", "token"])
def test_gspo_matches_naive_reference(level, kl_coef, est, dtype, tol):
    lp, mask, adv, old, ref, _ = inputs(dtype=dtype)
    fn = GSPO(0.1, 0.15, kl_coef, est, level)
    out = call(fn, lp, mask, adv, old, ref)
    want, grad = gspo_reference(lp, old, ref, adv, mask, eps_low=0.1, eps_high=0.15, kl_coef=kl_coef,
                                est=est, nvt=int(mask.sum()), ns=8)
    assert 0 < want["clip_fraction"] < 0.5  # both branches exercised
    assert out.loss.dtype == dtype
    assert_matches(out, lp, want, grad, kl_coef, tol)


def test_gspo_token_level_equals_sequence_level_with_one_advantage_per_completion():
    """GSPO-token's s_it has the value of s_i and ∂s_it/∂logp_it = s_i: same loss, same gradient."""
    outs = []
    for level in ("sequence", "token"):
        lp, mask, adv, old, ref, _ = inputs(seed=3)
        out = call(GSPO(0.05, 0.05, 0.1, level=level), lp, mask, adv, old, ref)
        out.loss.backward()
        outs.append((out, lp.grad))
    (seq, g_seq), (tok, g_tok) = outs
    torch.testing.assert_close(tok.loss, seq.loss, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(g_tok, g_seq, rtol=1e-14, atol=1e-14)
    for name, value in seq.metrics.items():
        torch.testing.assert_close(tok.metrics[name], value, rtol=1e-14, atol=1e-14)


# -- CISPO --------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps_low, weights, clip_fraction", [
    (None, [1.2, E(-0.5), 1.0], 1 / 3),
    (0.2, [1.2, 0.8, 1.0], 2 / 3),
])
def test_cispo_hand_values(eps_low, weights, clip_fraction):
    """old 0, logp [0.5, -0.5, 0], A=+1, ε_high 0.2: ratio [1.6487, 0.6065, 1].
    No lower bound: w = [1.2, 0.6065, 1]; loss -(1.2·0.5 - 0.6065·0.5 + 0)/3 = -0.098912.
    ε_low 0.2: w = [1.2, 0.8, 1]; loss -(0.6 - 0.4)/3 = -0.066667.
    Gradient -w·A/3 on every token, clipped ones included (PPO clipping would zero token 0)."""
    lp = leaf([[0.5, -0.5, 0.0]])
    out = call(CISPO(eps_low, 0.2), lp, [[1, 1, 1]], [1.0], torch.zeros(1, 3))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(weights[0] * 0.5 - weights[1] * 0.5) / 3, abs=1e-12)
    assert out.loss.item() == pytest.approx(-0.098912 if eps_low is None else -0.066667, abs=1e-6)
    assert out.metrics["clip_fraction"].item() == pytest.approx(clip_fraction)
    torch.testing.assert_close(lp.grad, -torch.tensor([weights], dtype=torch.float64) / 3)
    assert (lp.grad != 0).all()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("eps_low, eps_high, kl_coef, est", [
    (None, 0.3, 0.0, "k3"), (0.2, 0.3, 0.1, "k3"), (None, 0.3, 0.1, "k2"), (0.2, 4.0, 0.1, "k1"),
])
def test_cispo_matches_naive_reference(eps_low, eps_high, kl_coef, est, dtype, tol):
    lp, mask, adv, old, ref, _ = inputs(dtype=dtype)
    out = call(CISPO(eps_low, eps_high, kl_coef, est), lp, mask, adv, old, ref)
    want, grad = cispo_reference(lp, old, ref, adv, mask, eps_low=eps_low, eps_high=eps_high,
                                 kl_coef=kl_coef, est=est, nvt=int(mask.sum()))
    assert 0 < want["clip_fraction"] < 0.5
    assert_matches(out, lp, want, grad, kl_coef, tol)


def test_cispo_defaults_cap_weights_at_five():
    fn = CISPO()
    assert fn.clip_eps_low is None and fn.clip_eps_high == 4.0
    lp = leaf([[2.0, -5.0]])  # ratios e^2 ≈ 7.39 (capped at 5) and e^-5 (no lower bound)
    call(fn, lp, [[1, 1]], [1.0], torch.zeros(1, 2)).loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-5.0, -E(-5.0)]], dtype=torch.float64) / 2)


# -- ClippedSurrogate options ------------------------------------------------------------------

def test_delta_caps_the_unclipped_ratio_for_negative_advantages():
    """ε = 0.2, δ = 3, old 0, token mean over 3 one-token rows.
    A=-1, ratio e^1.5 ≈ 4.4817 > δ: min(min(r, δ)·A, clip(r)·A) = min(-3, -1.2) = -3 -> loss 3,
    gradient 0 (without δ: loss 4.4817, gradient 4.4817/3). A=-1, ratio e^0.5 < δ: loss 1.6487,
    unchanged. A=+1, ratio e^1.5: the ε clip gives -1.2 either way. clip_fraction 2/3."""
    lp = leaf([[1.5], [0.5], [1.5]])
    out = call(ClippedSurrogate(aggregation="token", delta=3.0), lp, [[1]] * 3, [-1.0, -1.0, 1.0],
               torch.zeros(3, 1))
    out.loss.backward()
    assert out.loss.item() == pytest.approx((3 + E(0.5) - 1.2) / 3, abs=1e-12)
    assert out.metrics["clip_fraction"].item() == pytest.approx(2 / 3)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0], [E(0.5) / 3], [0.0]], dtype=torch.float64))
    lp0 = leaf([[1.5], [0.5], [1.5]])
    base = call(ClippedSurrogate(aggregation="token"), lp0, [[1]] * 3, [-1.0, -1.0, 1.0], torch.zeros(3, 1))
    base.loss.backward()
    assert base.loss.item() == pytest.approx((E(1.5) + E(0.5) - 1.2) / 3, abs=1e-12)
    assert lp0.grad[0, 0].item() == pytest.approx(E(1.5) / 3)


def test_counts_and_mask_truncated():
    """Rows: 3 tokens (truncated), 2 tokens, 1 token (truncated), 0 tokens."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    trunc = torch.tensor([True, False, True, False])
    assert ClippedSurrogate().counts(mask, trunc) == (6, 4)
    assert ClippedSurrogate().counts(mask) == (6, 4)
    assert ClippedSurrogate(mask_truncated=True).counts(mask, trunc) == (2, 2)
    assert ClippedSurrogate(mask_truncated=True).counts(mask, torch.ones(4, dtype=torch.bool)) == (0, 0)
    assert GSPO().counts(mask, trunc) == (6, 4) and CISPO().counts(mask, trunc) == (6, 4)
    with pytest.raises(ValueError, match="mask_truncated=True needs is_truncated"):
        ClippedSurrogate(mask_truncated=True).counts(mask)


@pytest.mark.parametrize("aggregation", AGGS)
def test_mask_truncated_equals_dropping_the_rows(aggregation):
    """Truncated rows add nothing: same loss, gradient and metrics as the batch without them."""
    fn = ClippedSurrogate(0.2, 0.28, 0.1, aggregation, MAX_LEN, mask_truncated=True, entropy_coef=0.01)
    lp, mask, adv, old, ref, ent = inputs()
    out = call(fn, lp, mask, adv, old, ref, truncated=TRUNCATED, entropy=ent)
    out.loss.backward()
    keep = ~torch.tensor(TRUNCATED)
    lp2, ent2 = lp.detach()[keep].requires_grad_(), ent.detach()[keep].requires_grad_()
    plain = dataclasses.replace(fn, mask_truncated=False)
    want = call(plain, lp2, mask[keep], adv[keep], old[keep], ref[keep], entropy=ent2)
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad[keep], lp2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent.grad[keep], ent2.grad, rtol=1e-12, atol=1e-12)
    assert not lp.grad[~keep].any() and not ent.grad[~keep].any()
    for name, value in want.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("aggregation, expected",
                         [("sequence", -0.375), ("token", -1 / 3), ("constant", -0.125)])
def test_entropy_bonus_hand_values_and_sign(aggregation, expected):
    """A = 0 (no policy term), entropy_coef 0.5. Row 0 H = [1], row 1 H = [0.5, 0.5].
    Aggregated H: sequence (1/1 + 1/2)/2 = 0.75; token (1 + 0.5 + 0.5)/3 = 2/3; constant
    (L = 4) 2/(2·4) = 0.25. loss = -0.5 · that = -0.375 / -1/3 / -0.125; the metric
    ``entropy`` is the token mean 2/3 in every case."""
    fn = ClippedSurrogate(aggregation=aggregation, max_completion_tokens=4, entropy_coef=0.5)
    assert fn.requires.entropy and fn.requires.zero_advantage_rows
    ent = leaf([[1.0, math.nan], [0.5, 0.5]])
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    out = call(fn, leaf(zeros), [[1, 0], [1, 1]], [0.0, 0.0], entropy=ent)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.metrics["entropy"].item() == pytest.approx(2 / 3, abs=1e-12)
    assert (ent.grad[[0, 1, 1], [0, 0, 1]] < 0).all() and ent.grad[0, 1] == 0  # more entropy, lower loss
    higher = call(fn, leaf(zeros), [[1, 0], [1, 1]], [0.0, 0.0], entropy=ent.detach() + 0.1)
    assert higher.loss.item() < out.loss.item()


def test_entropy_missing_or_unused():
    fn = ClippedSurrogate(entropy_coef=0.1)
    with pytest.raises(ValueError, match=r"entropy_coef=0.1 needs batch.entropy"):
        call(fn, leaf([[0.0]]), [[1]], [1.0])
    with pytest.raises(ValueError, match=r"entropy shape \(1, 2\) must equal"):
        call(fn, leaf([[0.0]]), [[1]], [1.0], entropy=torch.zeros(1, 2))
    out = call(ClippedSurrogate(), leaf([[0.0]]), [[1]], [1.0], entropy=torch.zeros(1, 1))
    assert "entropy" not in out.metrics and not ClippedSurrogate().requires.entropy


def test_kl_estimator_lookup():
    assert kl_estimator("k1") is kl_k1 and kl_estimator("k2") is kl_k2 and kl_estimator("k3") is kl_k3
    assert tuple(KL_ESTIMATORS) == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match=r"kl_estimator='k4' is not one of \('k1', 'k2', 'k3'\)"):
        kl_estimator("k4")
    for cls in (ClippedSurrogate, GSPO, CISPO):
        with pytest.raises(ValueError, match=r"kl_estimator='low_var_kl' is not one of"):
            cls(kl_estimator="low_var_kl")


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimator_in_the_loss_value_and_gradient(est):
    """A = 0, token mean: loss = β·mean k, ∂/∂logp = β·k'/nvt with k1' = 1, k2' = logp - ref
    (the derivative of ½(log ratio)²) and k3' = 1 - ρ."""
    lp, mask, _, _, ref, _ = inputs()
    out = call(ClippedSurrogate(kl_coef=0.5, aggregation="token", kl_estimator=est), lp, mask,
               torch.zeros(8, dtype=torch.float64), ref=ref)
    out.loss.backward()
    nvt = int(mask.sum())
    x = torch.where(mask, ref - lp.detach(), torch.zeros(()))
    value = {"k1": -x, "k2": 0.5 * x**2, "k3": x.exp() - x - 1}[est]
    slope = {"k1": torch.ones_like(x), "k2": -x, "k3": 1 - x.exp()}[est]
    assert out.loss.item() == pytest.approx(0.5 * value[mask].sum().item() / nvt, rel=1e-12)
    assert out.metrics["kl"].item() == pytest.approx(value[mask].sum().item() / nvt, rel=1e-12)
    torch.testing.assert_close(lp.grad, torch.where(mask, 0.5 * slope / nvt, torch.zeros(())))


def test_k2_in_the_loss_has_the_reverse_kl_gradient_on_policy():
    """Exact expectation over a 4-way categorical, one row per outcome x weighted by sg(π(x)):
    Σ_x π(x) ∇loss_x with k2 is ∇KL(π‖ref); with k1 it is 0; with k3 it is not ∇KL(π‖ref)."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(4, generator=g, dtype=torch.float64), 0)
    (reverse,) = torch.autograd.grad((theta.softmax(0) * (theta.log_softmax(0) - log_ref)).sum(), theta)
    got = {}
    for est in ("k1", "k2", "k3"):
        logp = theta.log_softmax(0)
        fn = ClippedSurrogate(kl_coef=1.0, aggregation="token", kl_estimator=est)
        losses = [call(fn, logp[x].view(1, 1), [[1]], [0.0], ref=log_ref[x].view(1, 1), counts=(1, 1)).loss
                  for x in range(4)]
        (got[est],) = torch.autograd.grad(sum(logp[x].exp().detach() * losses[x] for x in range(4)), theta)
    torch.testing.assert_close(got["k2"], reverse)
    torch.testing.assert_close(got["k1"], torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (got["k3"] - reverse).abs().max() > 1e-2


# -- properties shared by every loss ------------------------------------------------------------

def configs():
    """Every loss with a mix of its options (with and without zero-advantage needs)."""
    yield from (ClippedSurrogate(0.2, 0.28, 0.05, agg, MAX_LEN, delta=1.5, kl_estimator="k2",
                                 mask_truncated=True, entropy_coef=0.01) for agg in AGGS)
    yield from (GSPO(0.1, 0.15, kl, "k3", level) for level in ("sequence", "token") for kl in (0.0, 0.05))
    yield ClippedSurrogate(0.2, 0.28, aggregation="token", delta=1.5, mask_truncated=True)
    yield from (CISPO(), CISPO(0.2, 0.3, 0.05, "k1"))


CONFIGS = list(configs())


@pytest.mark.parametrize("fn", CONFIGS, ids=repr)
@pytest.mark.parametrize("micro_batch_size", [2, 4])
def test_micro_batches_sum_to_the_full_batch(fn, micro_batch_size):
    lp, mask, adv, old, ref, ent = inputs(dtype=torch.float32)
    trunc = torch.tensor(TRUNCATED)
    counts = fn.counts(mask, trunc)
    full = call(fn, lp, mask, adv, old, ref, truncated=trunc, entropy=ent, counts=counts)
    full_grads = torch.autograd.grad(full.loss, (lp, ent), allow_unused=True)
    parts = [call(fn, lp[s], mask[s], adv[s], old[s], ref[s], truncated=trunc[s], entropy=ent[s],
                  counts=counts)
             for s in (slice(i, i + micro_batch_size) for i in range(0, 8, micro_batch_size))]
    total = sum(p.loss for p in parts)
    acc_grads = torch.autograd.grad(total, (lp, ent), allow_unused=True)
    torch.testing.assert_close(total, full.loss, rtol=0, atol=1e-6)
    for acc, ref_grad in zip(acc_grads, full_grads):
        if ref_grad is not None:
            torch.testing.assert_close(acc, ref_grad, rtol=0, atol=1e-6)
    for name, value in full.metrics.items():
        torch.testing.assert_close(sum(p.metrics[name] for p in parts), value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fn", CONFIGS, ids=repr)
def test_padding_columns_and_empty_rows_change_nothing(fn):
    lp, mask, adv, old, ref, ent = inputs(lengths=(4, 1, 3, 2), width=4)
    trunc = torch.tensor([False, True, False, False])
    counts = fn.counts(mask, trunc)
    base = call(fn, lp, mask, adv, old, ref, truncated=trunc, entropy=ent, counts=counts)
    base.loss.backward()

    def pad(x, shift):
        junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30], dtype=x.dtype)
        big = junk.roll(shift).repeat(9)[:42].view(6, 7)
        big[:4, :4] = x.detach()
        return big

    big_lp, big_ent = pad(lp, 0).requires_grad_(), pad(ent, 3).requires_grad_()
    big_mask = torch.zeros(6, 7, dtype=torch.bool)
    big_mask[:4, :4] = mask
    big_adv = torch.cat([adv[:4], torch.tensor([5.0, -5.0], dtype=torch.float64)])
    big_trunc = torch.cat([trunc, torch.tensor([False, True])])
    out = call(fn, big_lp, big_mask, big_adv, pad(old, 1), pad(ref, 2), truncated=big_trunc,
               entropy=big_ent, counts=counts)
    out.loss.backward()
    assert torch.isfinite(big_lp.grad).all()
    assert not big_lp.grad[:, 4:].any() and not big_lp.grad[4:].any()
    torch.testing.assert_close(out.loss, base.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(big_lp.grad[:4, :4], lp.grad, rtol=1e-12, atol=1e-12)
    for name, value in base.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", CONFIGS, ids=repr)
def test_gradients_flow_only_into_logprobs_and_entropy_with_the_advantage_sign(fn):
    lp, mask, adv, old, ref, ent = inputs(seed=2)
    old, ref = old.nan_to_num().requires_grad_(), ref.nan_to_num().requires_grad_()
    adv = adv.requires_grad_()
    trunc = torch.tensor(TRUNCATED)
    batch = MicroBatch(mask, adv, old, ref, trunc, entropy=ent)
    nvt, ns = fn.counts(mask, trunc)
    fn(lp, batch, num_valid_tokens=nvt, num_sequences=ns).loss.backward()
    for t in (old, ref, adv):
        assert t.grad is None or not t.grad.any()
    assert lp.grad.abs().sum() > 0
    # On-policy, without KL or entropy: d loss / d logp_it has the sign of -A_i on every kept token.
    plain = dataclasses.replace(fn, kl_coef=0.0,
                                **({"entropy_coef": 0.0} if hasattr(fn, "entropy_coef") else {}))
    lp2 = lp.detach().requires_grad_()
    call(plain, lp2, mask, adv.detach(), truncated=trunc, entropy=ent.detach()).loss.backward()
    kept = mask & ~trunc[:, None] if getattr(fn, "mask_truncated", False) else mask
    sign = torch.sign(-adv.detach())[:, None].expand_as(mask)
    torch.testing.assert_close(torch.sign(lp2.grad)[kept], sign[kept])


@pytest.mark.parametrize("fn", CONFIGS, ids=repr)
def test_on_policy_ratio_is_exactly_one(fn):
    """old None: every ratio is 1, nothing is clipped, and the surrogate gradient is
    -A/|o|/ns (GSPO), -A/nvt (CISPO) or the aggregation weight of ClippedSurrogate times -A."""
    fn = dataclasses.replace(fn, kl_coef=0.0,
                             **({"entropy_coef": 0.0} if hasattr(fn, "entropy_coef") else {}))
    lp, mask, adv, _, _, ent = inputs()
    trunc = torch.tensor(TRUNCATED)
    out = call(fn, lp, mask, adv, truncated=trunc, entropy=ent)
    out.loss.backward()
    assert out.metrics["clip_fraction"].item() == 0.0
    nvt, ns = fn.counts(mask, trunc)
    kept = mask & ~trunc[:, None] if getattr(fn, "mask_truncated", False) else mask
    lengths = kept.sum(1, keepdim=True).clamp(min=1).double()
    weight = {GSPO: 1 / (lengths * ns),
              CISPO: torch.full_like(lengths, 1 / nvt, dtype=torch.float64)}.get(type(fn))
    if weight is None:
        weight = {"sequence": 1 / (lengths * ns),
                  "token": torch.full_like(lengths, 1 / nvt, dtype=torch.float64),
                  "constant": torch.full_like(lengths, 1 / (ns * MAX_LEN),
                                              dtype=torch.float64)}[fn.aggregation]
    torch.testing.assert_close(lp.grad, torch.where(kept, -adv[:, None] * weight, torch.zeros(())),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("fn", CONFIGS, ids=repr)
def test_needs_zero_advantage_rows_tells_the_truth(fn):
    """Dropping the zero-advantage rows (same step counts) changes nothing exactly when the
    loss says they are not needed."""
    lp, mask, adv, old, ref, ent = inputs()
    trunc = torch.tensor(TRUNCATED)
    counts = fn.counts(mask, trunc)
    full = call(fn, lp, mask, adv, old, ref, truncated=trunc, entropy=ent, counts=counts)
    full.loss.backward()
    rows = adv != 0
    lp2, ent2 = lp.detach()[rows].requires_grad_(), ent.detach()[rows].requires_grad_()
    part = call(fn, lp2, mask[rows], adv[rows], old[rows], ref[rows], truncated=trunc[rows], entropy=ent2,
                counts=counts)
    part.loss.backward()
    same = (torch.equal(full.loss.detach(), part.loss.detach()) and torch.equal(lp.grad[rows], lp2.grad)
            and not lp.grad[~rows].any()
            and all(torch.equal(v, part.metrics[k]) for k, v in full.metrics.items()))
    assert same != fn.requires.zero_advantage_rows


@pytest.mark.parametrize("fn", CONFIGS, ids=repr)
def test_gradcheck(fn):
    """Autograd against finite differences. CISPO's gradient is, by design, not the derivative
    of its value off-policy (the weight is stop-gradient), so it is checked on-policy, where
    the weight is 1 whatever the perturbation."""
    lp, mask, adv, old, ref, ent = inputs(seed=1, lengths=(3, 1, 2, 0), width=3)
    trunc = torch.tensor([False, True, False, False])
    if isinstance(fn, CISPO):
        old = None
    assert torch.autograd.gradcheck(
        lambda x, h: call(fn, x, mask, adv, old, ref, truncated=trunc, entropy=h).loss, (lp, ent))


@pytest.mark.parametrize("cls, kwargs, message", [
    (ClippedSurrogate, dict(delta=1.2), r"delta=1.2 must be > 1 \+ clip_eps_high = 1.2"),
    (ClippedSurrogate, dict(clip_eps_high=0.28, delta=1.0), r"delta=1.0 must be > 1 \+ clip_eps_high"),
    (ClippedSurrogate, dict(entropy_coef=-0.1), r"entropy_coef=-0.1 must be >= 0"),
    (GSPO, dict(clip_eps_low=-1.0, kl_coef=-1.0), r"clip_eps_low=-1.0.*kl_coef=-1.0"),
    (GSPO, dict(level="tokens"), r"level='tokens' is not one of \('sequence', 'token'\)"),
    (CISPO, dict(clip_eps_low=-0.1), r"clip_eps_low=-0.1 must be >= 0"),
    (CISPO, dict(clip_eps_high=float("nan")), r"clip_eps_high=nan must be >= 0"),
])
def test_constructor_validation(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize("fn", [ClippedSurrogate(mask_truncated=True), GSPO(kl_coef=0.1), CISPO(kl_coef=0.1)],
                         ids=repr)
def test_call_validation(fn):
    name = type(fn).__name__
    with pytest.raises(ValueError, match=rf"{name}: num_valid_tokens=0 must be >= 1"):
        call(fn, leaf([[0.0]]), [[1]], [1.0], ref=torch.zeros(1, 1), truncated=[False], counts=(0, 1))
    if name == "ClippedSurrogate":
        with pytest.raises(ValueError, match=r"mask_truncated=True needs is_truncated"):
            call(fn, leaf([[0.0]]), [[1]], [1.0], counts=(1, 1))
    else:
        with pytest.raises(ValueError, match=rf"{name}: kl_coef=0.1 needs batch.ref_logprobs"):
            call(fn, leaf([[0.0]]), [[1]], [1.0])


def test_defaults_properties_and_protocol():
    assert (GSPO().clip_eps_low, GSPO().clip_eps_high, GSPO().level) == (3e-4, 4e-4, "sequence")
    for fn in (GSPO(), CISPO(), ClippedSurrogate(delta=4.0)):
        assert isinstance(fn, GRPOLoss)
        assert (not fn.requires.ref_logprobs and not fn.requires.entropy
                and not fn.requires.zero_advantage_rows)
        with pytest.raises(dataclasses.FrozenInstanceError):
            fn.kl_coef = 1.0  # type: ignore[misc]
    for fn in (GSPO(kl_coef=0.1), CISPO(kl_coef=0.1), ClippedSurrogate(kl_coef=0.1)):
        assert fn.requires.ref_logprobs and fn.requires.zero_advantage_rows
    out = call(GSPO(), leaf([[0.0]], torch.bfloat16), [[1]], [1.0])
    assert out.loss.dtype == torch.float32
