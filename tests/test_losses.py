"""Numbers for ClippedSurrogate and the k1/k2/k3 KL estimators (grpo_engine.losses)."""

import dataclasses
import math

import pytest
import torch

from grpo_engine.losses import ClippedSurrogate, kl_k1, kl_k2, kl_k3
from grpo_engine.protocols import GRPOLoss
from grpo_engine.types import MicroBatch

LN2 = math.log(2.0)
AGGS = ("sequence", "token", "constant")
MAX_LEN = 8  # max_completion_tokens for "constant"


def run(fn, logprobs, mask, adv, old=None, ref=None, *, num_valid_tokens=None, num_sequences=None):
    """Calls ``fn`` on one micro-batch; the counts default to those of this batch."""
    mask = torch.as_tensor(mask, dtype=torch.bool)
    batch = MicroBatch(mask, torch.as_tensor(adv, dtype=torch.float64), old, ref)
    nvt = int(mask.sum()) if num_valid_tokens is None else num_valid_tokens
    ns = mask.shape[0] if num_sequences is None else num_sequences
    return fn(logprobs, batch, num_valid_tokens=nvt, num_sequences=ns)


def leaf(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype).requires_grad_()


def random_inputs(seed=0, lengths=(6, 1, 3, 0, 2, 6, 4, 1), width=6, dtype=torch.float64):
    """Mixed lengths (one-token rows, an all-False row), a zero-advantage group, garbage pads."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    logprobs = -3 * torch.rand(n, width, generator=g, dtype=torch.float64)
    old = logprobs + 0.4 * torch.randn(n, width, generator=g, dtype=torch.float64)
    ref = logprobs + 0.5 * torch.randn(n, width, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[4:] = 0.0  # second group: all rewards equal
    logprobs[~mask], old[~mask], ref[~mask] = float("nan"), float("inf"), float("-inf")
    return logprobs.to(dtype).requires_grad_(), mask, adv, old.to(dtype), ref.to(dtype)


def reference(lp, old, ref, adv, mask, *, eps_low, eps_high, kl_coef, aggregation, nvt, ns, delta=None,
              est="k3"):
    """Naive fp64 loop over sequences and tokens, straight from the paper formulas
    (δ: INTELLECT-2's cap on the unclipped ratio; est: Schulman's k1/k2/k3)."""
    lp, old, ref, adv, mask = (x.detach().double().tolist() for x in (lp, old, ref, adv, mask))
    out = dict(loss=0.0, policy_loss=0.0, clip_fraction=0.0, kl=0.0)
    grad = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        length = sum(row)
        if aggregation == "sequence":
            w = 1.0 / (length * ns) if length else 0.0
        else:
            w = 1.0 / nvt if aggregation == "token" else 1.0 / (ns * MAX_LEN)
        for t, keep in enumerate(row):
            if not keep:
                continue
            ratio = math.exp(lp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            capped = ratio if delta is None else min(ratio, delta)
            surrogate = min(capped * adv[i], clipped * adv[i])
            clip_active = clipped * adv[i] < capped * adv[i] or (capped != ratio and adv[i] != 0)
            x = ref[i][t] - lp[i][t]
            kl, d_kl = {"k1": (-x, 1.0), "k2": (x * x / 2, -x),
                        "k3": (math.exp(x) - x - 1, 1 - math.exp(x))}[est]
            out["loss"] += w * (-surrogate + kl_coef * kl)
            out["policy_loss"] += w * -surrogate
            out["clip_fraction"] += clip_active / nvt
            out["kl"] += kl / nvt
            d_surrogate = 0.0 if clip_active else -ratio * adv[i]
            grad[i][t] = w * (d_surrogate + kl_coef * d_kl)
    return out, torch.tensor(grad, dtype=torch.float64)


E = math.exp


@pytest.mark.parametrize("adv, token_loss, grad", [
    (1.0, [-1, -1.2, -E(-0.5)], [-1 / 3, 0, -E(-0.5) / 3]),
    (-1.0, [1, E(0.5), 0.8], [1 / 3, E(0.5) / 3, 0]),
])
def test_hand_values_positive_and_negative_advantage(adv, token_loss, grad):
    """old=0, logprobs [0, 0.5, -0.5] -> ratio [1, e^0.5≈1.6487, e^-0.5≈0.6065];
    clip(ratio, 0.8, 1.2) = [1, 1.2, 0.8]; token mean over 3 tokens.

    A=+1: min(ratio, clip) = [1, 1.2, 0.6065] -> loss [-1, -1.2, -0.6065], mean -0.93551.
    Token 1 is clipped: gradient 0 there, -ratio·A/3 elsewhere (negative: good tokens go up).
    A=-1: min(-ratio, -clip) = [-1, -1.6487, -0.8] -> loss [1, 1.6487, 0.8], mean 1.14957.
    Token 2 is clipped: gradient 0 there, -ratio·A/3 = [0.3333, 0.5496] elsewhere.
    """
    lp = leaf([[0.0, 0.5, -0.5]])
    out = run(ClippedSurrogate(aggregation="token"), lp, [[1, 1, 1]], [adv], torch.zeros(1, 3))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(sum(token_loss) / 3, abs=1e-12)
    assert out.loss.item() == pytest.approx(-0.93551 if adv > 0 else 1.14957, abs=1e-5)
    assert out.metrics["clip_fraction"].item() == pytest.approx(1 / 3)
    torch.testing.assert_close(lp.grad, torch.tensor([grad], dtype=torch.float64))


def test_clip_higher_is_asymmetric():
    """eps_low=0.2, eps_high=0.28: ratio e^0.5 with A=+1 -> 1.28 (loss -1.28); ratio e^-0.5 with
    A=-1 -> 0.8 (loss +0.8). Token mean (-1.28 + 0.8)/2 = -0.24, both tokens clipped."""
    fn = ClippedSurrogate(aggregation="token", clip_eps_high=0.28)
    out = run(fn, leaf([[0.5], [-0.5]]), [[1], [1]], [1.0, -1.0], torch.zeros(2, 1))
    assert out.loss.item() == pytest.approx(-0.24, abs=1e-12)
    assert out.metrics["clip_fraction"].item() == 1.0


@pytest.mark.parametrize(
    "aggregation, expected", [("sequence", -0.75), ("token", -1 / 3), ("constant", -0.125)]
)
def test_aggregation_hand_values(aggregation, expected):
    """On-policy (ratio 1): row 0 has 1 token, A=2 -> loss [-2]; row 1 has 2 tokens, A=-0.5 ->
    [0.5, 0.5]. sequence: (-2/1 + 1/2)/2 = -0.75; token: (-2 + 0.5 + 0.5)/3 = -1/3;
    constant (max_completion_tokens 4): (-2 + 1)/(2·4) = -0.125."""
    fn = ClippedSurrogate(aggregation=aggregation, max_completion_tokens=4)
    lp = leaf([[-1.0, float("nan"), 0.0], [-2.0, -0.3, float("inf")]])
    out = run(fn, lp, [[1, 0, 0], [1, 1, 0]], [2.0, -0.5])
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)


def test_kl_estimators_hand_values_and_gradients():
    """logp = 0, ref = [ln2, -ln2, 0], so ρ = [2, 0.5, 1]: k1 = [-ln2, ln2, 0];
    k2 = ½ln2² = [0.2402, 0.2402, 0]; k3 = ρ - 1 - lnρ = [0.3069, 0.1931, 0].
    d/dlogp: k1 -> 1, k2 -> logp - ref = [-ln2, ln2, 0], k3 -> 1 - ρ = [-1, 0.5, 0]."""
    ref = torch.tensor([LN2, -LN2, 0.0], dtype=torch.float64)
    cases = [(kl_k1, [-LN2, LN2, 0.0], [1.0, 1.0, 1.0]),
             (kl_k2, [0.5 * LN2**2] * 2 + [0.0], [-LN2, LN2, 0.0]),
             (kl_k3, [1 - LN2, LN2 - 0.5, 0.0], [-1.0, 0.5, 0.0])]
    for fn, value, grad in cases:
        lp = leaf([0.0, 0.0, 0.0])
        k = fn(lp, ref)
        k.sum().backward()
        torch.testing.assert_close(k, leaf(value).detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(lp.grad, leaf(grad).detach(), rtol=0, atol=1e-12)
    half = torch.zeros(2, dtype=torch.bfloat16)
    assert kl_k3(half, half + 1).dtype == torch.float32
    with pytest.raises(ValueError, match="ref_logprobs shape"):
        kl_k3(torch.zeros(2, 3), torch.zeros(2, 4))


def test_kl_expected_gradients_on_policy():
    """Exact expectation over a 5-way categorical: E_x~π[∇k(x)] = Σ_x sg(π(x)) ∇k(x).
    k1 -> 0; k2 -> ∇KL(π‖ref); k3 -> ∇KL(ref‖π) (biased for the reverse KL)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)

    def grad_of(f):
        (grad,) = torch.autograd.grad(f(torch.log_softmax(theta, 0)), theta)
        return grad

    def expected(k):
        return grad_of(lambda logp: (logp.exp().detach() * k(logp, log_ref)).sum())

    reverse = grad_of(lambda logp: (logp.exp() * (logp - log_ref)).sum())
    forward = grad_of(lambda logp: (log_ref.exp() * (log_ref - logp)).sum())
    torch.testing.assert_close(expected(kl_k1), torch.zeros_like(theta), rtol=0, atol=1e-12)
    torch.testing.assert_close(expected(kl_k2), reverse)
    torch.testing.assert_close(expected(kl_k3), forward)
    assert (expected(kl_k3) - reverse).abs().max() > 1e-2


def test_kl_term_in_loss_hand_value():
    """A=0, logp=0, ref=[ln2, -ln2]: k3 = [1-ln2, ln2-0.5], sum 0.5, token mean 0.25;
    kl_coef 0.5 gives loss 0.125, metric kl 0.25 and policy_loss 0."""
    ref = torch.tensor([[LN2, -LN2]], dtype=torch.float64)
    fn = ClippedSurrogate(kl_coef=0.5, aggregation="token")
    out = run(fn, leaf([[0.0, 0.0]]), [[1, 1]], [0.0], ref=ref)
    assert out.loss.item() == pytest.approx(0.125, abs=1e-12)
    assert out.metrics["kl"].item() == pytest.approx(0.25, abs=1e-12)
    assert out.metrics["policy_loss"].item() == 0.0


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("aggregation", AGGS)
def test_matches_naive_reference(aggregation, kl_coef, dtype, tol):
    lp, mask, adv, old, ref = random_inputs(dtype=dtype)
    fn = ClippedSurrogate(0.2, 0.28, kl_coef, aggregation, MAX_LEN)
    nvt, ns = int(mask.sum()), mask.shape[0]
    out = run(fn, lp, mask, adv, old, ref)
    out.loss.backward()
    want, grad = reference(lp, old, ref, adv, mask, eps_low=0.2, eps_high=0.28,
                           kl_coef=kl_coef, aggregation=aggregation, nvt=nvt, ns=ns)
    assert 0 < want["clip_fraction"] < 1  # the random inputs exercise both branches
    assert out.loss.dtype == dtype
    assert out.loss.item() == pytest.approx(want.pop("loss"), rel=tol, abs=tol)
    if not kl_coef:
        assert "kl" not in out.metrics
        want.pop("kl")
    for name, value in want.items():
        assert out.metrics[name].item() == pytest.approx(value, rel=tol, abs=tol), name
        assert not out.metrics[name].requires_grad
    torch.testing.assert_close(lp.grad.double(), grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("delta, est", [(1.5, "k3"), (2.0, "k2"), (None, "k1")])
@pytest.mark.parametrize("aggregation", AGGS)
def test_delta_and_kl_estimators_match_naive_reference(aggregation, delta, est):
    lp, mask, adv, old, ref = random_inputs(seed=4)
    old = old.clone()
    old[0, :3] = lp.detach()[0, :3] - 1.0  # ratio e ≈ 2.72 > δ on three tokens of row 0 (A < 0)
    fn = ClippedSurrogate(0.2, 0.28, 0.1, aggregation, MAX_LEN, delta=delta, kl_estimator=est)
    nvt, ns = int(mask.sum()), mask.shape[0]
    out = run(fn, lp, mask, adv, old, ref)
    out.loss.backward()
    want, grad = reference(lp, old, ref, adv, mask, eps_low=0.2, eps_high=0.28, kl_coef=0.1,
                           aggregation=aggregation, nvt=nvt, ns=ns, delta=delta, est=est)
    assert adv[0] < 0 and 0 < want["clip_fraction"] < 1
    assert out.loss.item() == pytest.approx(want.pop("loss"), rel=1e-10, abs=1e-10)
    for name, value in want.items():
        assert out.metrics[name].item() == pytest.approx(value, rel=1e-10, abs=1e-10), name
    torch.testing.assert_close(lp.grad, grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("aggregation", AGGS)
def test_gradcheck(aggregation):
    lp, mask, adv, old, ref = random_inputs(seed=1)
    fn = ClippedSurrogate(0.2, 0.28, 0.1, aggregation, MAX_LEN)
    assert torch.autograd.gradcheck(lambda x: run(fn, x, mask, adv, old, ref).loss, (lp,))


def test_no_gradient_into_old_ref_or_advantages():
    lp, mask, adv, old, ref = random_inputs()
    old, ref = old.nan_to_num().requires_grad_(), ref.nan_to_num().requires_grad_()
    adv = adv.requires_grad_()
    batch = MicroBatch(mask, adv, old, ref)
    out = ClippedSurrogate(kl_coef=0.1)(lp, batch, num_valid_tokens=23, num_sequences=8)
    out.loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    for t in (old, ref, adv):
        assert t.grad is None or not t.grad.any()


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("aggregation", AGGS)
def test_padding_columns_and_empty_rows_change_nothing(aggregation, kl_coef):
    """Extra garbage columns and extra all-False rows (same step counts) leave loss and grad."""
    fn = ClippedSurrogate(kl_coef=kl_coef, aggregation=aggregation, max_completion_tokens=MAX_LEN)
    lp, mask, adv, old, ref = random_inputs(lengths=(4, 1, 3, 2), width=4)
    base = run(fn, lp, mask, adv, old, ref)
    base.loss.backward()

    def pad(x, shift):
        """[4, 4] -> [6, 7]: 3 more columns and 2 more rows of garbage (nan, ±inf, ±1e30)."""
        junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30], dtype=x.dtype)
        big = junk.roll(shift).repeat(9)[:42].view(6, 7)
        big[:4, :4] = x.detach()
        return big

    big_lp = pad(lp, 0).requires_grad_()
    big_mask = torch.zeros(6, 7, dtype=torch.bool)
    big_mask[:4, :4] = mask
    big_adv = torch.cat([adv, torch.tensor([5.0, -5.0], dtype=torch.float64)])
    out = run(fn, big_lp, big_mask, big_adv, pad(old, 1), pad(ref, 2),
              num_valid_tokens=10, num_sequences=4)
    out.loss.backward()
    assert torch.isfinite(big_lp.grad).all()
    assert not big_lp.grad[:, 4:].any() and not big_lp.grad[4:].any()
    torch.testing.assert_close(out.loss, base.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(big_lp.grad[:4, :4], lp.grad, rtol=1e-12, atol=1e-12)
    for name, value in base.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("micro_batch_size", [2, 4])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("aggregation", AGGS)
def test_micro_batches_sum_to_the_full_batch(aggregation, kl_coef, micro_batch_size):
    fn = ClippedSurrogate(0.2, 0.28, kl_coef, aggregation, MAX_LEN)
    lp, mask, adv, old, ref = random_inputs(dtype=torch.float32)
    counts = dict(num_valid_tokens=int(mask.sum()), num_sequences=8)
    full = run(fn, lp, mask, adv, old, ref, **counts)
    (full_grad,) = torch.autograd.grad(full.loss, lp)
    parts = [run(fn, lp[s], mask[s], adv[s], old[s], ref[s], **counts)
             for s in (slice(i, i + micro_batch_size) for i in range(0, 8, micro_batch_size))]
    (acc_grad,) = torch.autograd.grad(sum(p.loss for p in parts), lp)
    torch.testing.assert_close(sum(p.loss for p in parts), full.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(acc_grad, full_grad, rtol=0, atol=1e-6)
    for name, value in full.metrics.items():
        torch.testing.assert_close(sum(p.metrics[name] for p in parts), value, rtol=0, atol=1e-6)


def test_on_policy_ratio_is_one_and_gradient_is_minus_a_over_length():
    lp, mask, adv, _, _ = random_inputs()
    out = run(ClippedSurrogate(), lp, mask, adv)
    out.loss.backward()
    assert out.metrics["clip_fraction"].item() == 0.0
    lengths = mask.sum(1, keepdim=True).clamp(min=1)
    want = torch.where(mask, -adv[:, None] / (lengths * 8), torch.zeros(()))
    torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kwargs, message", [
    (dict(clip_eps_low=-0.1), r"clip_eps_low=-0.1 must be >= 0"),
    (dict(clip_eps_high=-0.1), r"clip_eps_high=-0.1 must be >= 0"),
    (dict(clip_eps_low=float("nan")), r"clip_eps_low=nan"),
    (dict(kl_coef=-1.0), r"kl_coef=-1.0 must be >= 0"),
    (dict(aggregation="mean"), r"'mean' is not one of \('sequence', 'token', 'constant'\)"),
    (dict(aggregation="constant"), r"pass max_completion_tokens"),
    (dict(max_completion_tokens=0), r"max_completion_tokens=0 must be >= 1"),
    (dict(clip_eps_low=-1, kl_coef=-1, aggregation="x"), r"clip_eps_low.*kl_coef.*aggregation"),
])
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClippedSurrogate(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_valid_tokens=0), r"num_valid_tokens=0 must be >= 1"),
    (dict(num_sequences=0), r"num_sequences=0 must be >= 1"),
    (dict(ref=None), r"kl_coef=0.1 needs batch.ref_logprobs"),
    (dict(adv=[1.0]), r"advantages shape \(1,\) must be \[n\]"),
    (dict(old=torch.zeros(2, 3)), r"old_logprobs shape \(2, 3\) must equal"),
])
def test_call_validation(kwargs, message):
    args = dict(adv=[1.0, 1.0], ref=torch.zeros(2, 2), num_valid_tokens=4, num_sequences=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        run(ClippedSurrogate(kl_coef=0.1), leaf([[0.0, 0.0]] * 2), [[1, 1]] * 2, **args)


def test_defaults_properties_and_protocol():
    assert ClippedSurrogate().clip_eps_high == 0.2 and ClippedSurrogate(0.1).clip_eps_high == 0.1
    assert not ClippedSurrogate().requires.ref_logprobs
    assert ClippedSurrogate(kl_coef=0.04).requires.ref_logprobs
    assert isinstance(ClippedSurrogate(), GRPOLoss)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClippedSurrogate().kl_coef = 1.0  # type: ignore[misc]
    out = run(ClippedSurrogate(), leaf([[0.0]], torch.bfloat16), [[1]], [1.0])
    assert out.loss.dtype == torch.float32


def test_truncated_importance_sampling_weight_hand_case():
    """Two tokens, A = +1, on-policy (old = current), sampler log-probs lower by ln 2 and higher by ln 2:
    weights min(e^{ln 2}, 1.5) = 1.5 and e^{-ln 2} = 0.5; token aggregation over 2 tokens gives
    loss = -(1.5 + 0.5) / 2 = -1.0 and d loss / d logp = [-0.75, -0.25] (the weight is detached)."""
    from grpo_engine.types import MicroBatch

    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ln2 = math.log(2.0)
    batch = MicroBatch(completion_mask=torch.ones(1, 2, dtype=torch.bool), advantages=torch.tensor([1.0]),
                       sampler_logprobs=torch.tensor([[-1.0 - ln2, -2.0 + ln2]]))
    loss_fn = ClippedSurrogate(aggregation="token", tis_cap=1.5)
    assert loss_fn.requires.sampler_logprobs
    out = loss_fn(logp, batch, num_valid_tokens=2, num_sequences=1)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0)
    assert logp.grad[0].tolist() == pytest.approx([-0.75, -0.25])
    assert out.metrics["tis_weight"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="tis_cap=1.5 needs batch.sampler_logprobs"):
        loss_fn(logp, MicroBatch(completion_mask=batch.completion_mask, advantages=batch.advantages),
                num_valid_tokens=2, num_sequences=1)
    assert out.metrics["mismatch/capped_fraction"].item() == pytest.approx(0.5)  # the first hit the cap


@pytest.mark.parametrize("mode, weights", [
    # token ratios 2 and 1/2 (first row), 3 and 1 (second row, its last token padding); cap 1.5
    ("token_truncate", [[1.5, 0.5], [1.5, 0.0]]),
    ("token_mask", [[0.0, 0.5], [0.0, 0.0]]),
    # sequence ratios 2 * 1/2 = 1 and 3
    ("sequence_truncate", [[1.0, 1.0], [1.5, 0.0]]),
    ("sequence_mask", [[1.0, 1.0], [0.0, 0.0]]),
])
def test_truncated_importance_sampling_modes_weigh_tokens_as_trl_names_them(mode, weights):
    """A = +1 on-policy, token aggregation over the 3 valid tokens: loss = -(sum of the weights) / 3 and
    d loss / d logp = -weight / 3 on each valid token."""
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -0.5]], requires_grad=True)
    ln2, ln3 = math.log(2.0), math.log(3.0)
    batch = MicroBatch(completion_mask=torch.tensor([[True, True], [True, False]]),
                       advantages=torch.tensor([1.0, 1.0]),
                       sampler_logprobs=torch.tensor([[-1.0 - ln2, -2.0 + ln2], [-1.0 - ln3, 0.0]]))
    out = ClippedSurrogate(aggregation="token", tis_cap=1.5, tis_mode=mode)(logp, batch, num_valid_tokens=3,
                                                                           num_sequences=2)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-sum(map(sum, weights)) / 3)
    torch.testing.assert_close(logp.grad, -torch.tensor(weights) / 3)
    capped = {"token_truncate": 2, "token_mask": 2, "sequence_truncate": 1, "sequence_mask": 1}[mode]
    assert out.metrics["mismatch/capped_fraction"].item() == pytest.approx(capped / 3)
    with pytest.raises(ValueError, match="tis_mode='token' is not one of"):
        ClippedSurrogate(tis_cap=1.5, tis_mode="token")


def test_a_new_loss_field_at_its_default_keeps_the_repr_a_checkpoint_saved():
    assert "tis_mode" not in repr(ClippedSurrogate(tis_cap=2.0))
    assert "tis_mode='sequence_mask'" in repr(ClippedSurrogate(tis_cap=2.0, tis_mode="sequence_mask"))
