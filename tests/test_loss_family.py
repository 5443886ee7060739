"""The 2026 loss family (issue 53): each loss against a naive float64 loop written from its paper's formula
(value and gradient: random cases, log-ratios of ±20, empty and one-token completions, all-truncated
groups) and, where TRL 1.16 has it, against TRL's own ``_compute_loss`` on the same tensors."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_engine.losses import DPPO, GMPO, LUSPO, SAPO, VESPO
from grpo_engine.protocols import GRPOLoss
from tests.test_loss_variants import call, inputs, k_value_grad, lists

E = math.exp
TOL = dict(rtol=1e-10, atol=1e-12)
TRL_TOL = dict(rtol=1e-6, atol=1e-6)  # TRL builds some constants in float32 (sapo's τ = 1.05 -> 1.04999995)


def sigmoid(x):
    return 1 / (1 + E(-x)) if x >= 0 else E(x) / (1 + E(x))


def clamp(x, low, high):
    return min(max(x, low), high)


def extreme(seed=0):
    """inputs() with every valid log-ratio pushed to ±20 or ±19.5 (π_θ/π_old from e^-20 to e^20)."""
    lp, mask, adv, old, ref, ent = inputs(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    pick = torch.tensor([20.0, -20.0, 19.5, -19.5], dtype=torch.float64)
    shift = pick[torch.randint(0, 4, mask.shape, generator=g)]
    return lp, mask, adv, torch.where(mask, lp.detach() - shift, old), ref


def cases():
    """(name, lp, mask, adv, old, ref): random, off-policy by ±20, and an all-truncated group of one-token and
    empty rows (truncation changes nothing for these losses: every row counts)."""
    lp, mask, adv, old, ref, _ = inputs(seed=0)
    yield "random", lp, mask, adv, old, ref
    lp, mask, adv, old, ref, _ = inputs(seed=5)
    yield "random-5", lp, mask, adv, old, ref
    yield ("extreme", *extreme(1))
    lp, mask, adv, old, ref, _ = inputs(seed=2, lengths=(1, 0, 1, 1), width=2)
    yield "one-token-and-empty", lp, mask, adv, old, ref


CASES = list(cases())


def check(fn, reference, case, *, truncated=None, tol=TOL):
    """``fn`` on a case equals the reference's value and gradient; everything finite."""
    _, lp, mask, adv, old, ref = case
    lp = lp.detach().clone().requires_grad_()
    out = call(fn, lp, mask, adv, old, ref, truncated=truncated)
    out.loss.backward()
    want, grad = reference(lp, old, ref, adv, mask)
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert out.loss.item() == pytest.approx(want, rel=tol["rtol"], abs=tol["atol"])
    torch.testing.assert_close(lp.grad, grad, **tol)
    return out


# -- TRL 1.16's own loss -------------------------------------------------------------------------

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")


class SingleProcess:
    """accelerate's collectives with one process: identities."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def gather_for_metrics(self, x):
        return x


def trl_loss(loss_type, lp, mask, adv, old, ref=None, *, beta=0.0, level="token", accumulation=1,
             num_items=None, epsilon=0.2, epsilon_high=None, trainer_cls=None, is_ratio=None, **args):
    """TRL's ``_compute_loss`` on one micro-batch; ``args`` are GRPOConfig fields it reads from ``self.args``
    (sapo_temperature_pos, vespo_k_pos, ...). ``lp``/``old``/``ref`` must be finite on padding. ``is_ratio``:
    the vLLM importance-sampling ratio TRL's generation step would pass (turns its correction on)."""
    trainer = object.__new__(trainer_cls or trl_grpo.GRPOTrainer)
    mask = torch.as_tensor(mask).long()
    n, width = mask.shape
    vars(trainer).update(
        loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, aux_loss_enabled=False,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        max_completion_length=width,
        current_gradient_accumulation_steps=accumulation, accelerator=SingleProcess(),
        model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list)}, entropy_coef=0.0,
        _entropy_bonus_enabled=False, use_adaptive_entropy=False,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=accumulation,
                             **args),
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
    )
    batch = dict(prompt_ids=torch.zeros(n, 1, dtype=torch.long),
                 prompt_mask=torch.ones(n, 1, dtype=torch.long),
                 completion_ids=torch.zeros(n, width, dtype=torch.long), completion_mask=mask,
                 advantages=torch.as_tensor(adv, dtype=lp.dtype), old_per_token_logps=old,
                 ref_per_token_logps=ref,
                 num_items_in_batch=torch.tensor(int(mask.sum()) if num_items is None else num_items))
    if is_ratio is not None:
        batch["importance_sampling_ratio"] = is_ratio
    return trainer._compute_loss(None, batch)


def against_trl(ours, trl_type, case, micro_batch_size, *, sampler=None, is_ratio=None, **trl_kwargs):
    """Loss and gradient of ours and of TRL over micro-batches of ``micro_batch_size`` rows of an 8-row case
    (TRL: gradient accumulation 8 / size, num_items the whole step's tokens); ``sampler`` [8, C] goes to ours
    as ``MicroBatch.sampler_logprobs``, ``is_ratio`` [8, C] to TRL as its vLLM importance-sampling ratio."""
    from grpo_engine.types import MicroBatch

    _, lp, mask, adv, old, ref = case
    zero = torch.zeros((), dtype=torch.float64)
    lp, old, ref = (torch.where(mask, x.detach(), zero) for x in (lp, old, ref))
    counts = ours.counts(mask)
    results = []
    for side in ("ours", "trl"):
        x, total = lp.clone().requires_grad_(), 0
        for s in (slice(i, i + micro_batch_size) for i in range(0, 8, micro_batch_size)):
            if side == "ours" and sampler is not None:
                batch = MicroBatch(mask[s], adv[s], old[s], ref[s], sampler_logprobs=sampler[s])
                total = total + ours(x[s], batch, num_valid_tokens=counts[0], num_sequences=counts[1]).loss
            elif side == "ours":
                total = total + call(ours, x[s], mask[s], adv[s], old[s], ref[s], counts=counts).loss
            else:
                total = total + trl_loss(trl_type, x[s], mask[s], adv[s], old[s], ref[s],
                                         accumulation=8 // micro_batch_size, num_items=int(mask.sum()),
                                         is_ratio=None if is_ratio is None else is_ratio[s], **trl_kwargs)
        total.backward()
        results.append((total.detach(), x.grad))
    (loss, grad), (trl_value, trl_grad) = results
    torch.testing.assert_close(loss, trl_value, **TRL_TOL)
    torch.testing.assert_close(grad, trl_grad, **TRL_TOL)
    assert grad.abs().sum() > 0


EIGHT_ROW_CASES = [c for c in CASES if c[1].shape[0] == 8]


# -- SAPO ----------------------------------------------------------------------------------------

def sapo_reference(lp, old, ref, adv, mask, *, tau_pos=1.0, tau_neg=1.05, kl_coef=0.0, est="k3",
                   agg="sequence", max_len=None):
    """SAPO, arXiv 2511.20347: f = σ(τ(ρ - 1))·4/τ, ℓ = -f·A, sequence mean of token means; ∂ℓ/∂log π =
    -A·4p(1-p)·ρ with p = σ(τ(ρ - 1))."""
    lp, old, ref, adv, mask = lists(lp, old, ref, adv, mask)
    n_seq, n_tok = len(mask), sum(sum(row) for row in mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, keep in enumerate(row) if keep]
        tau = tau_pos if adv[i] > 0 else tau_neg
        for t in idx:
            rho = E(clamp(lp[i][t] - old[i][t], -20, 20))
            p = sigmoid(tau * (rho - 1))
            k, dk = k_value_grad(est, lp[i][t], ref[i][t])
            weight = {"sequence": 1 / (len(idx) * n_seq), "token": 1 / n_tok,
                      "constant": 1 / (n_seq * (max_len or 1))}[agg]
            loss += weight * (-p * 4 / tau * adv[i] + kl_coef * k)
            grad[i][t] = weight * (-adv[i] * 4 * p * (1 - p) * rho + kl_coef * dk)
    return loss, torch.tensor(grad, dtype=torch.float64)


def test_sapo_hand_values():
    """τ_pos = 1, τ_neg = 1.05, old 0, one row each, N_seq = 2.
    Row 0, A = +1, logp [0, 0]: ρ = 1, f = σ(0)·4 = 2, ℓ = -2; gradient -1·4·¼·1 / (2·2) = -0.25 per token.
    Row 1, A = -1, logp [log 3]: ρ = 3, p = σ(2.1) = 0.890903, f = 4p/1.05 = 3.393917, ℓ = +3.393917;
    gradient +4p(1-p)·3 / 2 = 0.583168 (a clip at 1.2 would give 0: the gate only damps it).
    loss = (-2 + 3.393917)/2 = 0.696959."""
    lp = torch.tensor([[0.0, 0.0], [math.log(3), math.nan]], dtype=torch.float64, requires_grad=True)
    out = call(SAPO(), lp, [[1, 1], [1, 0]], [1.0, -1.0], torch.zeros(2, 2, dtype=torch.float64))
    out.loss.backward()
    p = sigmoid(2.1)
    assert out.loss.item() == pytest.approx((-2 + 4 * p / 1.05) / 2, abs=1e-12)
    assert out.loss.item() == pytest.approx(0.696959, abs=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -0.25], [4 * p * (1 - p) * 3 / 2, 0.0]],
                                                     dtype=torch.float64))
    assert lp.grad[1, 0].item() == pytest.approx(0.583168, abs=1e-6)
    assert out.metrics["clip_fraction"].item() == 0.0
    assert out.metrics["gate_damping"].item() == pytest.approx((1 - 4 * p * (1 - p)) / 3, abs=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("kwargs", [
    {}, dict(temperature_pos=0.5, temperature_neg=2.0, aggregation="token"),
    dict(aggregation="constant", max_completion_tokens=7, kl_coef=0.1, kl_estimator="k2"),
    dict(kl_coef=0.05),
], ids=str)
def test_sapo_matches_naive_reference(case, kwargs):
    fn = SAPO(**kwargs)
    ref_kwargs = dict(tau_pos=fn.temperature_pos, tau_neg=fn.temperature_neg, kl_coef=fn.kl_coef,
                      est=fn.kl_estimator, agg=fn.aggregation, max_len=fn.max_completion_tokens)
    check(fn, lambda *a: sapo_reference(*a, **ref_kwargs), case)
    truncated = [True] * case[2].shape[0]  # an all-truncated step: the same loss, nothing dropped
    check(fn, lambda *a: sapo_reference(*a, **ref_kwargs), case, truncated=truncated)


@pytest.mark.parametrize("case", EIGHT_ROW_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("ours, trl_kwargs", [
    (SAPO(), dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)),
    (SAPO(0.7, 1.5, kl_coef=0.1), dict(sapo_temperature_pos=0.7, sapo_temperature_neg=1.5, beta=0.1)),
], ids=repr)
def test_sapo_equals_trl(ours, trl_kwargs, case, micro_batch_size):
    against_trl(ours, "sapo", case, micro_batch_size, **trl_kwargs)


def test_sapo_on_policy_is_the_policy_gradient():
    """ρ = 1: ∂f/∂log π = 4·¼·1 = 1, so the gradient is -A/(L_i·N_seq), whatever τ."""
    lp, mask, adv, _, _, _ = inputs()
    call(SAPO(0.3, 3.0), lp, mask, adv).loss.backward()
    lengths = mask.sum(1, keepdim=True).clamp(min=1).double()
    torch.testing.assert_close(lp.grad, torch.where(mask, -adv[:, None] / (lengths * 8), 0.0).double())


# -- GMPO ----------------------------------------------------------------------------------------

def gmpo_reference(lp, old, ref, adv, mask, *, eps_low=0.4, eps_high=0.4, kl_coef=0.0, est="k3"):
    """GMPO, arXiv 2507.20673 eq. 4:
    ℓ_i = -sgn(A_i)·Π_t |min(ρ_t·A_i, clip(ρ_t, e^-ε_low, e^ε_high)·A_i)|^(1/L_i), mean over sequences;
    a token whose clipped term is the min has no gradient, the others
    ∂ℓ_i/∂log π_t = ℓ_i / L_i."""
    lp, old, ref, adv, mask = lists(lp, old, ref, adv, mask)
    n_seq = len(mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, keep in enumerate(row) if keep]
        if not idx:  # an empty completion adds nothing
            continue
        product, kept = 1.0, []
        for t in idx:
            rho = E(clamp(lp[i][t] - old[i][t], -20, 20))
            clipped = clamp(rho, E(-eps_low), E(eps_high))
            term = min(rho * adv[i], clipped * adv[i])
            if term == rho * adv[i]:
                kept.append(t)
            product *= abs(term) ** (1 / len(idx))
        seq = -math.copysign(1.0, adv[i]) * product if adv[i] != 0 else 0.0
        loss += seq / n_seq
        for t in idx:
            k, dk = k_value_grad(est, lp[i][t], ref[i][t])
            loss += kl_coef * k / (len(idx) * n_seq)
            grad[i][t] = (seq / len(idx) if t in kept else 0.0) / n_seq + kl_coef * dk / (len(idx) * n_seq)
    return loss, torch.tensor(grad, dtype=torch.float64)


def test_gmpo_hand_values():
    """ε = 0.4 (ratios clipped to (e^-0.4, e^0.4) = (0.6703, 1.4918)), old 0, N_seq = 2.
    Row 0, A = +1, log ratios [1.0, -0.2]: token 0 clipped at 0.4, so the geometric mean is e^((0.4 - 0.2)/2)
    = e^0.1 = 1.10517, ℓ = -1.10517; gradient [0, -1.10517/2/2 = -0.27629].
    Row 1, A = -1, log ratios [1.0, -0.2]: A < 0 keeps the larger, so nothing clips above: e^0.4 = 1.49182,
    ℓ = +1.49182; gradient [1.49182/4, 1.49182/4] = 0.37296 each (a token at -1.0 would be clipped at -0.4).
    loss = (-1.10517 + 1.49182)/2 = 0.19333; clip_fraction 1/4."""
    lp = torch.tensor([[1.0, -0.2], [1.0, -0.2]], dtype=torch.float64, requires_grad=True)
    out = call(GMPO(), lp, [[1, 1], [1, 1]], [1.0, -1.0], torch.zeros(2, 2, dtype=torch.float64))
    out.loss.backward()
    assert out.loss.item() == pytest.approx((-E(0.1) + E(0.4)) / 2, abs=1e-12)
    assert out.loss.item() == pytest.approx(0.19333, abs=1e-5)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -E(0.1) / 4], [E(0.4) / 4, E(0.4) / 4]],
                                                     dtype=torch.float64))
    assert out.metrics["clip_fraction"].item() == 0.25


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("kwargs", [{}, dict(clip_eps_low=0.1, clip_eps_high=0.3, kl_coef=0.1),
                                    dict(kl_coef=0.05, kl_estimator="k1")], ids=str)
def test_gmpo_matches_naive_reference(case, kwargs):
    fn = GMPO(**kwargs)
    ref_kwargs = dict(eps_low=fn.clip_eps_low, eps_high=fn.clip_eps_high, kl_coef=fn.kl_coef,
                      est=fn.kl_estimator)
    check(fn, lambda *a: gmpo_reference(*a, **ref_kwargs), case)
    check(fn, lambda *a: gmpo_reference(*a, **ref_kwargs), case, truncated=[True] * case[2].shape[0])


@pytest.mark.parametrize("case", EIGHT_ROW_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("ours, trl_kwargs", [
    (GMPO(), dict(epsilon=0.4)),
    (GMPO(0.2, 0.3, kl_coef=0.1), dict(epsilon=0.2, epsilon_high=0.3, beta=0.1)),
], ids=repr)
def test_gmpo_equals_trl_experimental_gmpo(ours, trl_kwargs, case, micro_batch_size):
    """Equal, except that TRL gives an empty completion the loss -A_i (its geometric mean of nothing is 1),
    a constant without gradient; here it adds 0. The empty rows' advantages are set to 0 for the comparison
    (the next test pins the difference)."""
    gmpo = pytest.importorskip("trl.experimental.gmpo")
    name, lp, mask, adv, old, ref = case
    adv = torch.where(mask.any(dim=1), adv, 0.0)
    against_trl(ours, "grpo", (name, lp, mask, adv, old, ref), micro_batch_size, trainer_cls=gmpo.GMPOTrainer,
                **trl_kwargs)


def test_gmpo_trl_counts_an_empty_completion_as_ratio_one():
    gmpo = pytest.importorskip("trl.experimental.gmpo")
    _, lp, mask, adv, old, ref = CASES[0]
    empty = ~mask.any(dim=1)
    assert empty.sum() == 1 and adv[empty].abs().sum() > 0.1
    zero = torch.zeros((), dtype=torch.float64)
    lp, old = torch.where(mask, lp.detach(), zero), torch.where(mask, old, zero)
    trl = trl_loss("grpo", lp, mask, adv, old, epsilon=0.4, trainer_cls=gmpo.GMPOTrainer)
    ours = call(GMPO(), lp, mask, adv, old).loss
    torch.testing.assert_close(trl - ours, -adv[empty].sum() / 8, **TRL_TOL)


# -- DPPO ----------------------------------------------------------------------------------------

def probability_cases():
    """Cases whose log-probs are log-probabilities (<= 0), as DPPO's divergences need: random; ratios e^±20
    between probabilities near 1 and near e^-20; one-token and empty rows."""
    for name, lp, mask, adv, old, ref in CASES:
        if name == "extreme":
            g = torch.Generator().manual_seed(7)
            coin = torch.rand(mask.shape, generator=g, dtype=torch.float64) < 0.5
            lp = torch.where(coin, -0.5, -20.5).double().requires_grad_()  # log-ratios of exactly ±20
            old = torch.where(mask, torch.where(coin, -20.5, -0.5).double(), old)
            ref = torch.where(mask, lp.detach() - 0.3, ref)  # the KL terms stay in k3's unclamped range
        else:
            old = torch.where(mask, old.clamp(max=0.0), old)
        yield name, lp, mask, adv, old, ref


PROBABILITY_CASES = list(probability_cases())


def dppo_reference(lp, old, ref, adv, mask, *, divergence="tv", delta_low=0.2, delta_high=0.2, agg="token",
                   max_len=None, kl_coef=0.0, est="k3"):
    """DPPO, arXiv 2602.04879: ℓ = -M·ρ·A with M = 0 when (A > 0, ρ > 1, D > δ) or (A < 0, ρ < 1, D > δ);
    D the binary TV |p - q| or binary KL(q‖p); ∂ℓ/∂log π = -M·ρ·A."""
    lp, old, ref, adv, mask = lists(lp, old, ref, adv, mask)
    n_seq, n_tok = len(mask), sum(sum(row) for row in mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, keep in enumerate(row) if keep]
        for t in idx:
            p, q = E(lp[i][t]), E(old[i][t])
            rho = E(clamp(lp[i][t] - old[i][t], -20, 20))
            slope = rho if abs(lp[i][t] - old[i][t]) <= 20 else 0.0  # the ±20 clamp stops the gradient
            if divergence == "tv":
                d = abs(p - q)
            elif p == 1 and q < 1:
                d = math.inf
            else:
                d = q * math.log(q / p) + ((1 - q) * math.log((1 - q) / (1 - p)) if q < 1 else 0.0)
            masked = (adv[i] > 0 and rho > 1 and d > delta_high) or (adv[i] < 0 and rho < 1 and d > delta_low)
            k, dk = k_value_grad(est, lp[i][t], ref[i][t])
            weight = {"sequence": 1 / (len(idx) * n_seq), "token": 1 / n_tok,
                      "constant": 1 / (n_seq * (max_len or 1))}[agg]
            loss += weight * ((0.0 if masked else -rho * adv[i]) + kl_coef * k)
            grad[i][t] = weight * ((0.0 if masked else -slope * adv[i]) + kl_coef * dk)
    return loss, torch.tensor(grad, dtype=torch.float64)


def test_dppo_hand_values():
    """Binary TV, δ = 0.2, token mean over 4 tokens.
    A = +1: p 0.5 vs q 0.2 (ρ = 2.5, D = 0.3 > δ, rising): masked. p 0.02 vs q 0.001 (ρ = 20, D = 0.019):
    kept, ℓ = -20, gradient -20/4 = -5 (PPO would clip it at 1.2).
    A = -1: p 0.1 vs q 0.5 (ρ = 0.2, D = 0.4, falling): masked. p 0.6 vs q 0.3 (ρ = 2, rising against a
    negative advantage): kept, ℓ = +2, gradient 0.5.
    loss = (-20 + 2)/4 = -4.5; clip_fraction 2/4."""
    lp = torch.tensor([[0.5, 0.02], [0.1, 0.6]], dtype=torch.float64).log().requires_grad_()
    old = torch.tensor([[0.2, 0.001], [0.5, 0.3]], dtype=torch.float64).log()
    out = call(DPPO(), lp, [[1, 1], [1, 1]], [1.0, -1.0], old)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-4.5, abs=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -5.0], [0.0, 0.5]], dtype=torch.float64))
    assert out.metrics["clip_fraction"].item() == 0.5


def test_dppo_binary_kl_value():
    """KL(q‖p) on {token, rest}, p 0.5, q 0.2: 0.2·ln(0.4) + 0.8·ln(1.6) = 0.192745 > 0.15 (masked at
    δ = 0.15, kept at δ = 0.2); p = 1 against q < 1 is +inf."""
    from grpo_engine.losses.dppo import binary_divergence

    logp = torch.tensor([[0.5, 1.0]], dtype=torch.float64).log()
    anchor = torch.tensor([[0.2, 0.3]], dtype=torch.float64).log()
    div = binary_divergence(logp, anchor, "kl")
    assert div[0, 0].item() == pytest.approx(0.2 * math.log(0.4) + 0.8 * math.log(1.6), abs=1e-12)
    assert div[0, 0].item() == pytest.approx(0.192745, abs=1e-6)
    assert div[0, 1].item() == math.inf
    lp = logp[:, :1].clone().requires_grad_()
    for delta, masked in ((0.15, True), (0.2, False)):
        out = call(DPPO("kl", delta_high=delta), lp, [[1]], [1.0], anchor[:, :1])
        assert out.metrics["clip_fraction"].item() == float(masked)


@pytest.mark.parametrize("case", PROBABILITY_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("kwargs", [
    {}, dict(divergence="kl", delta_low=0.05, delta_high=0.1),
    dict(delta_low=0.01, delta_high=0.3, aggregation="sequence", kl_coef=0.1),
    dict(divergence="kl", aggregation="constant", max_completion_tokens=9, kl_coef=0.05, kl_estimator="k2"),
], ids=str)
def test_dppo_matches_naive_reference(case, kwargs):
    fn = DPPO(**kwargs)
    ref_kwargs = dict(divergence=fn.divergence, delta_low=fn.delta_low, delta_high=fn.delta_high,
                      agg=fn.aggregation, max_len=fn.max_completion_tokens, kl_coef=fn.kl_coef,
                      est=fn.kl_estimator)
    out = check(fn, lambda *a: dppo_reference(*a, **ref_kwargs), case)
    if case[0] == "extreme":
        assert 0 < out.metrics["clip_fraction"].item() < 1
    check(fn, lambda *a: dppo_reference(*a, **ref_kwargs), case, truncated=[True] * case[2].shape[0])


def test_dppo_sampler_anchor_uses_the_sampler_logprobs():
    """anchor="sampler" is anchor="old" with the sampler's log-probs in place of π_old's."""
    from grpo_engine.types import MicroBatch

    _, lp, mask, adv, old, ref = PROBABILITY_CASES[0]
    fn = DPPO(anchor="sampler")
    assert fn.requires.sampler_logprobs and not DPPO().requires.sampler_logprobs
    garbage = torch.where(mask, old - 5.0, old)
    batch = MicroBatch(mask, adv, garbage, ref, sampler_logprobs=old)
    got = fn(lp, batch, num_valid_tokens=int(mask.sum()), num_sequences=8)
    want = call(DPPO(), lp, mask, adv, old, ref)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"DPPO: anchor='sampler' needs batch.sampler_logprobs"):
        fn(lp, MicroBatch(mask, adv, old, ref), num_valid_tokens=int(mask.sum()), num_sequences=8)


# -- LUSPO ---------------------------------------------------------------------------------------

def luspo_reference(lp, old, ref, adv, mask, *, eps_low=3e-4, eps_high=4e-4, kl_coef=0.0, est="k3"):
    """LUSPO, arXiv 2602.05261: GSPO's ℓ_i = -min(s_i A_i, clip(s_i) A_i) with s_i the geometric mean of the
    token ratios, times L_i, summed and divided by the number of sequences; unclipped, ∂/∂log π_it = -A_i s_i
    (the L_i cancels GSPO's 1/L_i)."""
    lp, old, ref, adv, mask = lists(lp, old, ref, adv, mask)
    n_seq = len(mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, keep in enumerate(row) if keep]
        if not idx:
            continue
        s = E(sum(lp[i][t] - old[i][t] for t in idx) / len(idx))
        c = clamp(s, 1 - eps_low, 1 + eps_high)
        clipped = c * adv[i] < s * adv[i]
        loss += -len(idx) * min(s * adv[i], c * adv[i]) / n_seq
        for t in idx:
            k, dk = k_value_grad(est, lp[i][t], ref[i][t])
            loss += kl_coef * k / n_seq
            grad[i][t] = (0.0 if clipped else -adv[i] * s) / n_seq + kl_coef * dk / n_seq
    return loss, torch.tensor(grad, dtype=torch.float64)


def test_luspo_hand_values():
    """ε = 0.2, old 0, N_seq = 2. Row 0: 3 tokens, log ratios [0.1, 0.1, 0.1], s = e^0.1 = 1.10517 in range,
    A = +1: ℓ = -1.10517, times L = 3: -3.31551; gradient -A·s/N_seq = -0.55259 on each token (GSPO: a third).
    Row 1: 1 token, log ratio 0.5, s = 1.64872 > 1.2, A = +1: clipped, ℓ = -1.2, times 1; no gradient.
    loss = (-3.31551 - 1.2)/2 = -2.25776; clip_fraction 1/2."""
    lp = torch.tensor([[0.1, 0.1, 0.1], [0.5, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    out = call(LUSPO(0.2, 0.2), lp, [[1, 1, 1], [1, 0, 0]], [1.0, 1.0], old)
    out.loss.backward()
    assert out.loss.item() == pytest.approx((-3 * E(0.1) - 1.2) / 2, abs=1e-12)
    assert out.loss.item() == pytest.approx(-2.25776, abs=1e-5)
    torch.testing.assert_close(lp.grad, torch.tensor([[-E(0.1) / 2] * 3, [0.0] * 3], dtype=torch.float64))
    assert out.metrics["clip_fraction"].item() == 0.5


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("kwargs", [
    {}, dict(clip_eps_low=0.1, clip_eps_high=0.15, kl_coef=0.1),
    dict(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, kl_estimator="k2"),
], ids=str)
def test_luspo_matches_naive_reference(case, kwargs):
    fn = LUSPO(**kwargs)
    ref_kwargs = dict(eps_low=fn.clip_eps_low, eps_high=fn.clip_eps_high, kl_coef=fn.kl_coef,
                      est=fn.kl_estimator)
    check(fn, lambda *a: luspo_reference(*a, **ref_kwargs), case)
    check(fn, lambda *a: luspo_reference(*a, **ref_kwargs), case, truncated=[True] * case[2].shape[0])


@pytest.mark.parametrize("case", EIGHT_ROW_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("ours, trl_kwargs", [
    (LUSPO(), dict(epsilon=3e-4, epsilon_high=4e-4)),
    (LUSPO(0.1, 0.15, kl_coef=0.1), dict(epsilon=0.1, epsilon_high=0.15, beta=0.1)),
], ids=repr)
def test_luspo_equals_trl(ours, trl_kwargs, case, micro_batch_size):
    against_trl(ours, "luspo", case, micro_batch_size, level="sequence", **trl_kwargs)


# -- VESPO ---------------------------------------------------------------------------------------

def vespo_reference(lp, old, ref, adv, mask, *, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0, agg="token",
                    max_len=None, kl_coef=0.0, est="k3", sampler=None, cap=None, mode="token_truncate"):
    """VESPO, arXiv 2602.10693 (App. I): W = Π_t ρ_t (log clamped as the paper's code does),
    φ = W^k e^(λ(1 - W)), ℓ_t = -sg[φ]·A·log π_t; ∂ℓ_t/∂log π_t = -φ·A."""
    lp, old, ref, adv, mask = lists(lp, old, ref, adv, mask)
    n_seq, n_tok = len(mask), sum(sum(row) for row in mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, keep in enumerate(row) if keep]
        log_w = sum(clamp(lp[i][t] - old[i][t], -20, 20) for t in idx)
        for t in idx if sampler is not None else ():
            r = E(old[i][t] - sampler[i][t])
            r = min(r, cap) if mode == "token_truncate" else (0.0 if r > cap else r)
            log_w += clamp(math.log(r) if r > 0 else -math.inf, math.log(1e-8), 20)
        log_w = clamp(log_w, math.log(1e-8), 20)
        w = E(log_w)
        k, lam = (k_pos, lam_pos) if adv[i] >= 0 else (k_neg, lam_neg)
        phi = w**k * E(lam * (1 - w))
        for t in idx:
            kl, dkl = k_value_grad(est, lp[i][t], ref[i][t])
            weight = {"sequence": 1 / (len(idx) * n_seq), "token": 1 / n_tok,
                      "constant": 1 / (n_seq * (max_len or 1))}[agg]
            loss += weight * (-phi * adv[i] * lp[i][t] + kl_coef * kl)
            grad[i][t] = weight * (-phi * adv[i] + kl_coef * dkl)
    return loss, torch.tensor(grad, dtype=torch.float64)


def test_vespo_hand_values():
    """Defaults (k, λ) = (2, 3) for A >= 0 and (3, 2) for A < 0; old 0; token mean over 3 tokens.
    Row 0, A = +1, logp [-0.2, 0.3]: W = e^0.1 = 1.10517, φ = W²·e^(3(1 - W)) = 1.22140·0.72941 = 0.89091;
    gradient -φ/3 = -0.29697 on both tokens.
    Row 1, A = -1, logp [-0.5]: W = e^-0.5 = 0.60653, φ = W³·e^(2(1 - W)) = 0.22313·2.19666 = 0.49014;
    gradient +φ/3 = 0.16338. loss = -(0.89091·(-0.2 + 0.3) + (-1)·0.49014·(-0.5))/3 = -0.11139."""
    lp = torch.tensor([[-0.2, 0.3], [-0.5, math.nan]], dtype=torch.float64, requires_grad=True)
    out = call(VESPO(), lp, [[1, 1], [1, 0]], [1.0, -1.0], torch.zeros(2, 2, dtype=torch.float64))
    out.loss.backward()
    phi0, phi1 = E(0.1) ** 2 * E(3 * (1 - E(0.1))), E(-0.5) ** 3 * E(2 * (1 - E(-0.5)))
    assert (phi0, phi1) == (pytest.approx(0.89091, abs=1e-5), pytest.approx(0.49014, abs=1e-5))
    assert out.loss.item() == pytest.approx(-(phi0 * 0.1 + phi1 * 0.5) / 3, abs=1e-12)
    assert out.loss.item() == pytest.approx(-0.11139, abs=1e-5)
    torch.testing.assert_close(lp.grad, torch.tensor([[-phi0 / 3, -phi0 / 3], [phi1 / 3, 0.0]],
                                                     dtype=torch.float64))
    assert out.metrics["vespo_damping"].item() == pytest.approx((2 * (1 - phi0) + 1 - phi1) / 3, abs=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("kwargs", [
    {}, dict(k_pos=1.0, lambda_pos=0.5, k_neg=4.0, lambda_neg=2.5, aggregation="sequence", kl_coef=0.1),
    dict(aggregation="constant", max_completion_tokens=8, kl_coef=0.05, kl_estimator="k2"),
], ids=str)
def test_vespo_matches_naive_reference(case, kwargs):
    fn = VESPO(**kwargs)
    ref_kwargs = dict(k_pos=fn.k_pos, lam_pos=fn.lambda_pos, k_neg=fn.k_neg, lam_neg=fn.lambda_neg,
                      agg=fn.aggregation, max_len=fn.max_completion_tokens, kl_coef=fn.kl_coef,
                      est=fn.kl_estimator)
    check(fn, lambda *a: vespo_reference(*a, **ref_kwargs), case)
    check(fn, lambda *a: vespo_reference(*a, **ref_kwargs), case, truncated=[True] * case[2].shape[0])


@pytest.mark.parametrize("case", EIGHT_ROW_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("ours, trl_kwargs", [
    (VESPO(), dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)),
    (VESPO(1.0, 0.5, 4.0, 2.5, kl_coef=0.1),
     dict(vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=2.5, beta=0.1)),
], ids=repr)
def test_vespo_equals_trl(ours, trl_kwargs, case, micro_batch_size):
    against_trl(ours, "vespo", case, micro_batch_size, **trl_kwargs)


def sampler_logprobs(case, seed=11):
    """The case's π_old shifted per token by N(0, 0.6²) and, on a few tokens, by ±3: the sampler's log-probs,
    so that π_old/π_sampler crosses a cap of 1.5 on both sides."""
    _, lp, mask, adv, old, ref = case
    g = torch.Generator().manual_seed(seed)
    shift = 0.6 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    jump = torch.rand(mask.shape, generator=g, dtype=torch.float64) < 0.15
    shift = torch.where(jump, 3.0 * shift.sign(), shift)
    return torch.where(mask, old - shift, old)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_sampler_correction_matches_naive_reference(case, mode):
    from grpo_engine.types import MicroBatch

    fn = VESPO(tis_cap=1.5, tis_mode=mode, kl_coef=0.1)
    assert fn.requires.sampler_logprobs and not VESPO().requires.sampler_logprobs
    sampler = sampler_logprobs(case)
    _, lp, mask, adv, old, ref = case
    lp = lp.detach().clone().requires_grad_()
    out = fn(lp, MicroBatch(mask, adv, old, ref, sampler_logprobs=sampler), num_valid_tokens=int(mask.sum()),
             num_sequences=mask.shape[0])
    out.loss.backward()
    want, grad = vespo_reference(lp, old, ref, adv, mask, kl_coef=0.1, sampler=sampler, cap=1.5, mode=mode)
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert out.loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(lp.grad, grad, **TOL)
    with pytest.raises(ValueError, match=r"VESPO: tis_cap=1.5 needs batch.sampler_logprobs"):
        call(fn, lp, mask, adv, old, ref)


@pytest.mark.parametrize("case", EIGHT_ROW_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_sampler_correction_equals_trl_vllm_importance_sampling(case, mode, micro_batch_size):
    """TRL with use_vllm: its generation step's ratio exp(old - sampler), truncated (clamp at clip_max) or
    masked (0 above it), then its own get_gamma_weights and _compute_loss."""
    sampler = sampler_logprobs(case)
    _, lp, mask, adv, old, ref = case
    ratio = torch.exp(torch.where(mask, old - sampler, 0.0))
    ratio = ratio.clamp(max=1.5) if mode == "token_truncate" else ratio.masked_fill(ratio > 1.5, 0.0)
    assert (ratio[mask] == (1.5 if mode == "token_truncate" else 0.0)).any()  # the cap acts
    against_trl(VESPO(tis_cap=1.5, tis_mode=mode), "vespo", case, micro_batch_size, sampler=sampler,
                is_ratio=ratio, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)


# -- shared properties ----------------------------------------------------------------------------

def family():
    yield from (SAPO(), SAPO(aggregation="token", kl_coef=0.1))
    yield from (GMPO(), GMPO(0.2, 0.3, kl_coef=0.1, kl_estimator="k2"))
    yield from (DPPO(), DPPO("kl", 0.05, 0.1, aggregation="sequence", kl_coef=0.1))
    yield from (LUSPO(), LUSPO(0.1, 0.15, kl_coef=0.1, kl_estimator="k1"))
    yield from (VESPO(), VESPO(aggregation="sequence", kl_coef=0.1))


@pytest.mark.parametrize("fn", list(family()), ids=repr)
def test_protocol_requirements_and_micro_batches(fn):
    assert isinstance(fn, GRPOLoss)
    assert fn.requires.ref_logprobs == (fn.kl_coef > 0) == fn.requires.zero_advantage_rows
    lp, mask, adv, old, ref, _ = inputs(dtype=torch.float32)
    counts = fn.counts(mask)
    full = call(fn, lp, mask, adv, old, ref, counts=counts)
    (full_grad,) = torch.autograd.grad(full.loss, lp)
    parts = [call(fn, lp[s], mask[s], adv[s], old[s], ref[s], counts=counts)
             for s in (slice(i, i + 2) for i in range(0, 8, 2))]
    (part_grad,) = torch.autograd.grad(sum(p.loss for p in parts), lp)
    torch.testing.assert_close(sum(p.loss for p in parts), full.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(part_grad, full_grad, rtol=0, atol=1e-6)
    for name, value in full.metrics.items():
        assert not value.requires_grad
        torch.testing.assert_close(sum(p.metrics[name] for p in parts), value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fn", list(family()), ids=repr)
def test_needs_zero_advantage_rows_tells_the_truth(fn):
    """Dropping the rows with A = 0 (same step counts) changes nothing exactly when the loss says so."""
    lp, mask, adv, old, ref, _ = inputs()
    old = torch.where(mask, old.clamp(max=0.0), old)  # log-probabilities, for DPPO's divergences
    counts = fn.counts(mask)
    full = call(fn, lp, mask, adv, old, ref, counts=counts)
    full.loss.backward()
    rows = adv != 0
    lp2 = lp.detach()[rows].requires_grad_()
    part = call(fn, lp2, mask[rows], adv[rows], old[rows], ref[rows], counts=counts)
    part.loss.backward()
    same = (torch.equal(full.loss.detach(), part.loss.detach()) and torch.equal(lp.grad[rows], lp2.grad)
            and not lp.grad[~rows].any()
            and all(torch.equal(v, part.metrics[k]) for k, v in full.metrics.items()))
    assert same != fn.requires.zero_advantage_rows


@pytest.mark.parametrize("fn", list(family()), ids=repr)
def test_gradcheck(fn):
    """Autograd against finite differences, off-policy; VESPO's weight is stop-gradient by design, so it is
    checked on-policy (W = 1 whatever the perturbation)."""
    lp, mask, adv, old, ref, _ = inputs(seed=1, lengths=(3, 1, 2, 0), width=3)
    old = None if isinstance(fn, VESPO) else torch.where(mask, old.clamp(max=0.0), old)
    lp = lp.detach().clamp(max=-0.05).requires_grad_()  # away from p = 1
    assert torch.autograd.gradcheck(lambda x: call(fn, x, mask, adv, old, ref).loss, (lp,))


@pytest.mark.parametrize("cls, kwargs, message", [
    (SAPO, dict(temperature_pos=0.0), r"temperature_pos=0.0 must be > 0"),
    (SAPO, dict(aggregation="constant"), r"max_completion_tokens, which must be >= 1"),
    (SAPO, dict(kl_estimator="k4"), r"kl_estimator='k4' is not one of"),
    (GMPO, dict(clip_eps_low=-0.1, kl_coef=-1.0), r"clip_eps_low=-0.1 must be >= 0.*kl_coef=-1.0"),
    (DPPO, dict(divergence="js", anchor="ref"), r"divergence='js' is not one of.*anchor='ref' is not one of"),
    (DPPO, dict(delta_high=-1.0), r"delta_high=-1.0 must be >= 0"),
    (LUSPO, dict(clip_eps_high=-1.0), r"clip_eps_high=-1.0 must be >= 0"),
    (VESPO, dict(k_neg=-1.0, lambda_pos=0.0), r"k_neg=-1.0 must be >= 0.*lambda_pos=0.0 must be > 0"),
    (VESPO, dict(tis_cap=0.0, tis_mode="sequence_mask"),
     r"tis_cap=0.0 must be > 0.*tis_mode='sequence_mask'"),
])
def test_constructor_validation(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize("yaml_loss, cli_set, want", [
    ("{class: grpo_engine.losses.SAPO}", "loss.temperature_neg=1.5", SAPO(temperature_neg=1.5)),
    ("{class: grpo_engine.losses.GMPO, clip_eps_low: 0.2}", "loss.kl_coef=0.01", GMPO(0.2, kl_coef=0.01)),
    ("{class: grpo_engine.losses.DPPO, divergence: kl}", "loss.anchor=sampler", DPPO("kl", anchor="sampler")),
    ("{class: grpo_engine.losses.LUSPO}", "loss.clip_eps_high=0.28", LUSPO(clip_eps_high=0.28)),
    ("{class: grpo_engine.losses.VESPO, k_pos: 1.0}", "loss.lambda_neg=2.5",
     VESPO(k_pos=1.0, lambda_neg=2.5)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_built_by_name_from_a_run_file_and_the_command_line(yaml_loss, cli_set, want):
    """A run file's ``loss:`` names the class and its keywords; ``grpo-engine train --set`` overrides one."""
    from grpo_engine.cli import _overridden
    from grpo_engine.config import load_yaml
    from grpo_engine.spec import RunSpec, build

    text = ("model: m\ntrain_prompts: {function: grpo_engine.data.load_gsm8k}\n"
            f"rewards: [{{class: grpo_engine.rewards.MathAccuracy}}]\nloss: {yaml_loss}\n")
    spec = RunSpec.model_validate(_overridden(load_yaml(text), [cli_set]))
    assert build(spec.loss) == want


@pytest.mark.parametrize("fn", list(family())[1::2], ids=repr)  # one of each, its second (KL) setting
def test_a_trainer_gradient_pass_runs_and_never_waits_for_the_device(tmp_path, monkeypatch, fn):
    """Each loss in the real trainer's gradient pass (tiny model, off-policy, with a reference): finite
    gradients, and no micro-batch reads a value back from the device."""
    from tests.test_host_sync import PLANS, make_trainer, micro_batch_syncs

    trainer = make_trainer(tmp_path, memory=PLANS["tiled, shared prompt"], loss=fn)
    assert micro_batch_syncs(trainer, monkeypatch) == []
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
