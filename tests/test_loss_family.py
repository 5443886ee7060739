"""The 2026 loss family (issue 53): each loss against a naive float64 loop written from its paper's formula
(value and gradient: random cases, log-ratios of ±20, empty and one-token completions, all-truncated
groups) and, where TRL 1.16 has it, against TRL's own ``_compute_loss`` on the same tensors."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_engine.losses import GMPO, SAPO
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
             num_items=None, epsilon=0.2, epsilon_high=None, trainer_cls=None, **args):
    """TRL's ``_compute_loss`` on one micro-batch; ``args`` are GRPOConfig fields it reads from ``self.args``
    (sapo_temperature_pos, vespo_k_pos, ...). ``lp``/``old``/``ref`` must be finite on padding."""
    trainer = object.__new__(trainer_cls or trl_grpo.GRPOTrainer)
    mask = torch.as_tensor(mask).long()
    n, width = mask.shape
    vars(trainer).update(
        loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, aux_loss_enabled=False, use_vllm=False,
        vllm_importance_sampling_correction=False, max_completion_length=width,
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
    return trainer._compute_loss(None, batch)


def against_trl(ours, trl_type, case, micro_batch_size, **trl_kwargs):
    """Loss and gradient of ours and of TRL over micro-batches of ``micro_batch_size`` rows of an 8-row case
    (TRL: gradient accumulation 8 / size, num_items the whole step's tokens)."""
    _, lp, mask, adv, old, ref = case
    zero = torch.zeros((), dtype=torch.float64)
    lp, old, ref = (torch.where(mask, x.detach(), zero) for x in (lp, old, ref))
    counts = ours.counts(mask)
    results = []
    for side in ("ours", "trl"):
        x, total = lp.clone().requires_grad_(), 0
        for s in (slice(i, i + micro_batch_size) for i in range(0, 8, micro_batch_size)):
            if side == "ours":
                total = total + call(ours, x[s], mask[s], adv[s], old[s], ref[s], counts=counts).loss
            else:
                total = total + trl_loss(trl_type, x[s], mask[s], adv[s], old[s], ref[s],
                                         accumulation=8 // micro_batch_size, num_items=int(mask.sum()),
                                         **trl_kwargs)
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


# -- shared properties ----------------------------------------------------------------------------

def family():
    yield from (SAPO(), SAPO(aggregation="token", kl_coef=0.1))
    yield from (GMPO(), GMPO(0.2, 0.3, kl_coef=0.1, kl_estimator="k2"))


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


@pytest.mark.parametrize("cls, kwargs, message", [
    (SAPO, dict(temperature_pos=0.0), r"temperature_pos=0.0 must be > 0"),
    (SAPO, dict(aggregation="constant"), r"max_completion_tokens, which must be >= 1"),
    (SAPO, dict(kl_estimator="k4"), r"kl_estimator='k4' is not one of"),
    (GMPO, dict(clip_eps_low=-0.1, kl_coef=-1.0), r"clip_eps_low=-0.1 must be >= 0.*kl_coef=-1.0"),
])
def test_constructor_validation(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize("name", ["SAPO", "GMPO"])
def test_built_by_name_from_a_run_file(name):
    from grpo_engine.spec import ComponentSpec, build

    loss = build(ComponentSpec.model_validate({"class": f"grpo_engine.losses.{name}"}))
    assert type(loss).__name__ == name
