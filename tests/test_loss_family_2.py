"""Issue 53, second part: GDPO, MaxRL, the off-policy sequence mask, two-sided importance sampling, ...
Each against a naive float64 loop written from its paper and, where TRL 1.16 has it, against TRL's own code
on the same inputs."""

import inspect
import math
import textwrap

import pytest
import torch

from grpo_engine.advantages import ReinforcePlusPlusBaseline
from grpo_engine.rewards import WeightedSum
from tests.test_rewards import Fixed, Q, make_batch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")


# -- GDPO: each reward z-scored within its group, then summed, then whitened over the batch --------------

def trl_normalize_then_sum(rewards_per_func, weights, num_generations):
    """TRL 1.16's own ``multi_objective_aggregation="normalize_then_sum"`` lines, cut out of
    ``GRPOTrainer._generate_and_score_completions`` by their source and run on [N, K] rewards."""
    source = textwrap.dedent(inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions))
    start = source.index('elif self.multi_objective_aggregation == "normalize_then_sum":')
    indent = start - source.rindex("\n", 0, start) - 1
    body = source[start:source.index("\n" + " " * indent + "else:", start)].split("\n", 1)[1]
    scope = dict(rewards_per_func=rewards_per_func, num_generations=num_generations, torch=torch,
                 nanstd=trl_grpo.nanstd, device=rewards_per_func.device,
                 unscorable_mask=torch.isnan(rewards_per_func).all(dim=1),
                 self=type("S", (), dict(reward_funcs=[None] * rewards_per_func.shape[1],
                                         reward_weights=weights))())
    exec(textwrap.dedent(body), scope)  # noqa: S102 - TRL's installed code, to compare with it
    return scope["advantages"]


def gdpo_reference(scores, weights, group_size, eps):
    """GDPO, arXiv 2601.05242: z_k = (s_k - mean_g s_k)/(std_g s_k + eps) per reward k and group g (unbiased
    std), t = Σ_k w_k z_k, A = (t - mean t)/(std t + eps) over the batch. Loops, float64."""
    n, k = len(scores), len(weights)
    t = [0.0] * n
    for j in range(k):
        for start in range(0, n, group_size):
            g = [scores[i][j] for i in range(start, start + group_size)]
            mean = sum(g) / group_size
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (group_size - 1))
            for i in range(start, start + group_size):
                t[i] += weights[j] * (scores[i][j] - mean) / (std + eps)
    mean = sum(t) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in t) / (n - 1))
    return torch.tensor([(x - mean) / (std + eps) for x in t], dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("group_size", [2, 4])
def test_gdpo_equals_trl_normalize_then_sum(seed, group_size):
    """WeightedSum(normalize='each', eps=1e-4) + ReinforcePlusPlusBaseline(eps=1e-4) is TRL's
    'normalize_then_sum': the same advantages as TRL's own lines and the float64 loop (float32 rewards),
    a reward constant in one group included; the default eps 1e-6 differs from TRL only by the eps."""
    gen = torch.Generator().manual_seed(seed)
    b, k = 3, 3
    scores = torch.stack([torch.randint(0, 2, (b * group_size,), generator=gen).double(),
                          torch.rand(b * group_size, generator=gen, dtype=torch.float64) * 50,
                          torch.randn(b * group_size, generator=gen, dtype=torch.float64)], dim=1)
    scores[:group_size, 0] = 1.0  # the binary reward is equal in the first group: it adds 0 there
    weights = torch.tensor([1.0, 0.5, -0.2], dtype=torch.float64)
    rewards = [Fixed(f"r{j}", scores[:, j].tolist(), weight=weights[j].item()) for j in range(k)]
    batch = make_batch([Q] * b, ["x"] * (b * group_size), group_size=group_size)
    total = WeightedSum(rewards, normalize="each", eps=1e-4)(batch).total
    ours = ReinforcePlusPlusBaseline(eps=1e-4)(total).flatten().double()
    trl = trl_normalize_then_sum(scores, weights, group_size)
    torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, gdpo_reference(scores.tolist(), weights.tolist(), group_size, 1e-4),
                               rtol=1e-5, atol=1e-5)
    default = ReinforcePlusPlusBaseline()(WeightedSum(rewards, normalize="each")(batch).total).flatten()
    torch.testing.assert_close(default.double(), gdpo_reference(scores.tolist(), weights.tolist(), group_size,
                                                                1e-6), rtol=1e-5, atol=1e-5)


def test_weighted_sum_eps_is_checked_and_shown():
    with pytest.raises(ValueError, match=r"WeightedSum: eps=-1.0 must be >= 0"):
        WeightedSum([Fixed("a", [1.0])], eps=-1.0)
    assert repr(WeightedSum([Fixed("a", [1.0])], normalize="each", eps=1e-4)).endswith(
        "normalize='each', eps=0.0001)")


# -- MaxRL ---------------------------------------------------------------------------------------------

def maxrl_reference(rewards, eps=0.0):
    """MaxRL, arXiv 2602.02710: p = mean of the group; A = (r - p)/(p + eps); 0 when the group is equal."""
    out = []
    for group in rewards:
        p = sum(group) / len(group)
        equal = all(x == group[0] for x in group)
        out.append([0.0 if equal else (x - p) / (p + eps) for x in group])
    return torch.tensor(out, dtype=torch.float64)


def test_maxrl_hand_values():
    """G = 4. One right of 4: p = 1/4, the right one (1 - 1/4)/(1/4) = 3, the wrong ones -1. Two right:
    p = 1/2, +1 and -1. All wrong or all right: 0 (no signal, no division by 0). GRPO would give the rare
    success 1.5 (z-score), MaxRL twice that: the likelihood gradient ∇p/p up-weights hard prompts."""
    from grpo_engine.advantages import MaxRL

    got = MaxRL()(torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    assert got.tolist() == [[3.0, -1, -1, -1], [1, 1, -1, -1], [0, 0, 0, 0], [0, 0, 0, 0]]
    # Σ_g A_g = G·(p - p)/p = 0: a baseline, so the expected gradient is unbiased
    assert got.sum(dim=1).abs().max() == 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_maxrl_matches_naive_reference(seed, eps):
    from grpo_engine.advantages import MaxRL

    gen = torch.Generator().manual_seed(seed)
    binary = torch.randint(0, 2, (6, 8), generator=gen).double()
    binary[0], binary[1] = 0.0, 1.0  # an all-wrong and an all-right group
    binary[2] = torch.tensor([1.0] + [0.0] * 7)  # one success in 8: advantage 7
    fractional = torch.rand(3, 5, generator=gen, dtype=torch.float64)  # rewards in [0, 1], not binary
    for rewards in (binary, fractional):
        got = MaxRL(eps=eps)(rewards)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, maxrl_reference(rewards.tolist(), eps), rtol=1e-12, atol=1e-12)
    assert MaxRL()(binary)[2, 0].item() == 7.0


def test_maxrl_refuses_rewards_outside_unit_interval_and_single_completions():
    from grpo_engine.advantages import MaxRL

    with pytest.raises(ValueError, match=r"MaxRL: rewards must lie in \[0, 1\]"):
        MaxRL()(torch.tensor([[1.0, -1.0]]))
    with pytest.raises(ValueError, match=r"MaxRL: group_size=1"):
        MaxRL()(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match=r"MaxRL: eps=-0.1 must be >= 0"):
        MaxRL(eps=-0.1)


# -- DeepSeek-V3.2: the off-policy sequence mask and the ratio-weighted (unbiased) KL -----------------------

from types import SimpleNamespace  # noqa: E402

from grpo_engine.losses import ClippedSurrogate  # noqa: E402
from grpo_engine.losses.terms import OffPolicySequenceMask  # noqa: E402
from grpo_engine.types import MicroBatch  # noqa: E402
from tests.test_loss_family import CASES, EIGHT_ROW_CASES, against_trl, clamp  # noqa: E402
from tests.test_loss_variants import k_value_grad, lists  # noqa: E402

E = math.exp


def sampler_of(old, amplitude=0.8):
    """A sampler's log-probs that differ from π_old's by a fixed function of them (TRL's side recomputes it
    from the micro-batch's old log-probs); 0 on padding."""
    return torch.where(torch.isfinite(old), old + amplitude * torch.sin(7 * torch.nan_to_num(old)), 0.0)


def trl_with(*, threshold=None, bias_correction=False, sampler=False):
    """GRPOTrainer with TRL 1.16's ``off_policy_mask_threshold`` / ``use_bias_correction_kl`` set (class
    properties win over the instance fields the shared harness writes), and ``sampling_per_token_logps``
    = sampler_of(old) in its inputs when ``sampler``."""
    class Trainer(trl_grpo.GRPOTrainer):
        off_policy_mask_threshold = property(lambda self: threshold)

        @property
        def args(self):
            fields = vars(self.__dict__["args"])
            return SimpleNamespace(**{**fields, "use_bias_correction_kl": bias_correction})

        def _compute_loss(self, model, inputs):
            if sampler:
                inputs = {**inputs, "sampling_per_token_logps": sampler_of(inputs["old_per_token_logps"])}
            return super()._compute_loss(model, inputs)

    return Trainer


def clipped_reference(lp, old, ref, adv, mask, sampler=None, *, eps=0.2, kl_coef=0.0, weighted=False,
                      threshold=None, est="k3"):
    """Token-mean clipped surrogate, arXiv 2512.02556 eqs. 7-9: a completion with A_i < 0 whose mean
    log(π_μ/π_θ) exceeds δ adds no policy term (μ: the sampler, else π_old); the KL β·ρ·k3 has gradient
    β(ρ·k + ρ·∂k) (ρ = π_θ/π_old). Loops, float64."""
    lp, old, ref, adv, mask = lists(lp, old, ref, adv, mask)
    anchor = old if sampler is None else lists(sampler)[0]
    n_tok = sum(sum(row) for row in mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, keep in enumerate(row) if keep]
        mean = sum(anchor[i][t] - lp[i][t] for t in idx) / max(len(idx), 1)
        keep = not (threshold is not None and adv[i] < 0 and mean > threshold)
        for t in idx:
            x = lp[i][t] - old[i][t]
            rho, slope = E(clamp(x, -20, 20)), (E(x) if abs(x) <= 20 else 0.0)
            c = clamp(rho, 1 - eps, 1 + eps)
            policy = -min(rho * adv[i], c * adv[i])
            dpolicy = -adv[i] * slope if rho * adv[i] <= c * adv[i] else 0.0
            k, dk = k_value_grad(est, lp[i][t], ref[i][t])
            w, dw = (rho, slope) if weighted else (1.0, 0.0)
            loss += (keep * policy + kl_coef * w * k) / n_tok
            grad[i][t] = (keep * dpolicy + kl_coef * (dw * k + w * dk)) / n_tok
    return loss, torch.tensor(grad, dtype=torch.float64)


def run(fn, case, sampler=None, truncated=None):
    _, lp, mask, adv, old, ref = case
    lp = lp.detach().clone().requires_grad_()
    batch = MicroBatch(mask, adv, old, ref, None if truncated is None else torch.tensor(truncated),
                       sampler_logprobs=sampler)
    n_tok, n_seq = fn.counts(mask)
    out = fn(lp, batch, num_valid_tokens=n_tok, num_sequences=n_seq)
    out.loss.backward()
    return out, lp


def test_off_policy_mask_hand_values():
    """δ = 0.5, token mean over 4 tokens, old = sampler = 0. Row 0, A = -1, log π_θ [-1, -1]: mean
    log(π_μ/π_θ) = 1 > δ, masked: no policy term, no gradient. Row 1, A = -1, log π_θ [-0.2, -0.4]: mean 0.3,
    kept: ρ = [e^-0.2, e^-0.4] = [0.8187, 0.6703]; A < 0 keeps max(ρ, clip(ρ)) = [0.8187, 0.8] (the second
    clipped), loss (0.8187 + 0.8)/4 = 0.40468, gradient [0.8187/4, 0]. Row 0 would drop the same way with
    A > 0? No: a positive advantage is never masked (the paper learns from its own successes)."""
    lp = torch.tensor([[-1.0, -1.0], [-0.2, -0.4]], dtype=torch.float64, requires_grad=True)
    fn = ClippedSurrogate(aggregation="token", off_policy_mask_threshold=0.5)
    batch = MicroBatch(torch.ones(2, 2, dtype=torch.bool), torch.tensor([-1.0, -1.0], dtype=torch.float64),
                       torch.zeros(2, 2, dtype=torch.float64))
    out = fn(lp, batch, num_valid_tokens=4, num_sequences=2)
    out.loss.backward()
    assert out.loss.item() == pytest.approx((E(-0.2) + 0.8) / 4, abs=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0], [E(-0.2) / 4, 0.0]], dtype=torch.float64))
    assert out.metrics["off_policy_masked_fraction"].item() == 0.5
    positive = MicroBatch(batch.completion_mask, torch.tensor([1.0, 1.0], dtype=torch.float64),
                          batch.old_logprobs)
    assert fn(lp, positive, num_valid_tokens=4, num_sequences=2).metrics["off_policy_masked_fraction"] == 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("kwargs", [
    dict(off_policy_mask_threshold=0.0), dict(off_policy_mask_threshold=0.3, kl_coef=0.1),
    dict(kl_coef=0.2, kl_ratio_weighted=True),
    dict(off_policy_mask_threshold=0.05, kl_coef=0.05, kl_ratio_weighted=True, clip_eps_low=0.1),
], ids=str)
@pytest.mark.parametrize("with_sampler", [False, True])
def test_deepseek_v32_terms_match_naive_reference(case, kwargs, with_sampler):
    fn = ClippedSurrogate(aggregation="token", **kwargs)
    sampler = sampler_of(case[4]) if with_sampler else None
    want, want_grad = clipped_reference(case[1], case[4], case[5], case[3], case[2], sampler,
                                        eps=fn.clip_eps_low, kl_coef=fn.kl_coef,
                                        weighted=fn.kl_ratio_weighted, threshold=fn.off_policy_mask_threshold)
    for truncated in (None, [True] * case[2].shape[0]):  # all truncated: nothing changes (no filter)
        out, lp = run(fn, case, sampler, truncated)
        assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
        assert out.loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
        torch.testing.assert_close(lp.grad, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", EIGHT_ROW_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("kwargs", [
    dict(off_policy_mask_threshold=0.0), dict(off_policy_mask_threshold=0.3, kl_coef=0.1),
    dict(kl_coef=0.2, kl_ratio_weighted=True),
    dict(off_policy_mask_threshold=0.05, kl_coef=0.05, kl_ratio_weighted=True),
], ids=str)
@pytest.mark.parametrize("with_sampler", [False, True])
def test_deepseek_v32_terms_equal_trl(case, micro_batch_size, kwargs, with_sampler):
    """TRL 1.16 ``loss_type="dapo"`` with ``off_policy_mask_threshold`` and ``use_bias_correction_kl``, and
    ``sampling_per_token_logps`` when a sampler reported its log-probs: the same loss and gradient."""
    fn = ClippedSurrogate(aggregation="token", **kwargs)
    trainer = trl_with(threshold=fn.off_policy_mask_threshold, bias_correction=fn.kl_ratio_weighted,
                       sampler=with_sampler)
    name, lp, mask, adv, old, ref = case
    old = torch.where(mask, old, 0.0)
    sampler = sampler_of(old) if with_sampler else None
    if sampler is None:
        against_trl(fn, "dapo", (name, lp, mask, adv, old, ref), micro_batch_size, trainer_cls=trainer,
                    beta=fn.kl_coef)
    else:  # ours reads the sampler from the MicroBatch; no importance-sampling correction on either side
        against_trl(fn, "dapo", (name, lp, mask, adv, old, ref), micro_batch_size, trainer_cls=trainer,
                    beta=fn.kl_coef, sampler=sampler)


def test_off_policy_mask_anchor_and_errors():
    case = CASES[0]
    with pytest.raises(ValueError, match=r"off_policy_mask_threshold=-1 must be >= 0"):
        ClippedSurrogate(off_policy_mask_threshold=-1)
    with pytest.raises(ValueError, match=r"kl_ratio_weighted=True weights the KL, but kl_coef=0"):
        ClippedSurrogate(kl_ratio_weighted=True)
    needs = ClippedSurrogate(terms=(OffPolicySequenceMask(0.1, anchor="sampler"),))
    assert needs.requires.sampler_logprobs
    assert not ClippedSurrogate(off_policy_mask_threshold=0.1).requires.sampler_logprobs
    with pytest.raises(ValueError, match=r"off_policy_mask_threshold=0.1"):
        run(needs, case)
    sampler = sampler_of(case[4])
    old_only = ClippedSurrogate(aggregation="token", terms=(OffPolicySequenceMask(0.0, anchor="old"),))
    got, _ = run(old_only, case, sampler)
    want, _ = clipped_reference(case[1], case[4], case[5], case[3], case[2], None, threshold=0.0)
    assert got.loss.item() == pytest.approx(want, rel=1e-10)
    assert repr(ClippedSurrogate()) == repr(ClippedSurrogate(off_policy_mask_threshold=None))
    assert "off_policy_mask_threshold" not in repr(ClippedSurrogate())


# -- Importance sampling against the sampler: lower and upper bounds, four modes; IcePop -------------------

from grpo_engine.losses.terms import TruncatedIS, icepop  # noqa: E402

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_is_ratio(old, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16's own vLLM importance-sampling lines (``_generate_and_score_completions``), run on [n, C]
    π_old and sampler log-probs: [n, C] (token modes) or [n, 1] (sequence modes)."""
    source = textwrap.dedent(inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions))
    block = source.index("if self.use_vllm and self.vllm_importance_sampling_correction:")
    start = source.index("mask = completion_mask if tool_mask is None", block)
    end = source.index("# Compute the per-token log probabilities for the reference model", start)
    scope = dict(old_per_token_logps=old, sampling_per_token_logps=sampler, completion_mask=mask.long(),
                 tool_mask=None, torch=torch, math=math,
                 self=SimpleNamespace(vllm_importance_sampling_mode=mode,
                                      vllm_importance_sampling_clip_min=clip_min,
                                      vllm_importance_sampling_clip_max=clip_max))
    indent = start - source.rindex("\n", 0, start) - 1
    exec(textwrap.dedent(" " * indent + source[start:end].rstrip()), scope)  # noqa: S102 - TRL's own code
    return scope["vllm_importance_sampling_ratio"]


def is_weights(old, sampler, mask, mode, low, high):
    """[n][C] importance weights from r = π_old/π_sampler, written out (loops): a token's own ratio or its
    sequence's product; truncated to [low, high], or kept where inside and 0 outside (None: unbounded)."""
    old, sampler, mask = lists(old, sampler, mask)
    low, high = -math.inf if low is None else low, math.inf if high is None else high
    out = []
    for i, row in enumerate(mask):
        seq = E(clamp(sum(old[i][t] - sampler[i][t] for t, keep in enumerate(row) if keep), -20, 20))
        weights = []
        for t in range(len(row)):
            r = seq if mode.startswith("sequence") else E(clamp(old[i][t] - sampler[i][t], -20, 20))
            if mode.endswith("truncate"):
                weights.append(clamp(r, low, high))
            else:
                weights.append(r if low <= r <= high else 0.0)
        out.append(weights)
    return out


def tis_reference(lp, old, adv, mask, weights, eps=0.2):
    """Token-mean clipped surrogate whose policy term is multiplied by fixed weights; loops, float64."""
    lp, old, adv, mask = lists(lp, old, adv, mask)
    n_tok = sum(sum(row) for row in mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        for t, keep in enumerate(row):
            if not keep:
                continue
            x = lp[i][t] - old[i][t]
            rho, slope = E(clamp(x, -20, 20)), (E(x) if abs(x) <= 20 else 0.0)
            c = clamp(rho, 1 - eps, 1 + eps)
            loss += weights[i][t] * -min(rho * adv[i], c * adv[i]) / n_tok
            grad[i][t] = weights[i][t] * (-adv[i] * slope if rho * adv[i] <= c * adv[i] else 0.0) / n_tok
    return loss, torch.tensor(grad, dtype=torch.float64)


BOUNDS = [(None, 2.0), (0.5, 2.0), (0.8, None), (0.2, 5.0)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low, high", BOUNDS, ids=str)
def test_two_sided_is_matches_naive_reference(case, mode, low, high):
    _, lp, mask, adv, old, ref = case
    sampler = sampler_of(old)
    fn = ClippedSurrogate(aggregation="token", tis_cap=high, tis_mode=mode, tis_cap_min=low)
    weights = is_weights(old, sampler, mask, mode, low, high)
    want, want_grad = tis_reference(lp, old, adv, mask, weights)
    for truncated in (None, [True] * mask.shape[0]):
        out, x = run(fn, case, sampler, truncated)
        assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
        assert out.loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
        torch.testing.assert_close(x.grad, want_grad, rtol=1e-10, atol=1e-12)
    flat = [w for row, keep in zip(weights, lists(mask)[0]) for w, k in zip(row, keep) if k]
    assert out.metrics["tis_weight"].item() == pytest.approx(sum(flat) / len(flat), rel=1e-10)


@pytest.mark.parametrize("case", EIGHT_ROW_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("micro_batch_size", [8, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low, high", BOUNDS, ids=str)
def test_two_sided_is_equals_trl(case, micro_batch_size, mode, low, high):
    """TRL 1.16 with vLLM importance sampling (``vllm_importance_sampling_mode`` = mode, ``_clip_min`` = low,
    ``_clip_max`` = high), its ratio made by its own lines: the same loss and gradient."""
    name, lp, mask, adv, old, ref = case
    old = torch.where(mask, old, 0.0)
    sampler = sampler_of(old, 0.25)  # sequence ratios near 1 too: some of each kind survive a mask
    ratio = trl_is_ratio(old, sampler, mask, mode, low, high)
    fn = ClippedSurrogate(aggregation="token", tis_cap=high, tis_mode=mode, tis_cap_min=low)
    against_trl(fn, "dapo", (name, lp, mask, adv, old, ref), micro_batch_size, sampler=sampler,
                is_ratio=ratio)


def test_icepop_hand_values_and_errors():
    """IcePop α = 0.5, β = 5, A = 1, on-policy (ρ = 1), token mean over 3 tokens; r = π_old/π_sampler =
    [0.4, 1.0, 4.0]: the first falls below α and leaves, the others keep their weight: loss -(1 + 4)/3,
    gradient [0, -1/3, -4/3]; mismatch/capped_fraction 1/3."""
    lp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    sampler = -torch.tensor([[0.4, 1.0, 4.0]], dtype=torch.float64).log()
    fn = ClippedSurrogate(aggregation="token", terms=(icepop(),))
    assert repr(icepop()) == "TruncatedIS(cap=5.0, mode='token_mask', cap_min=0.5)"
    batch = MicroBatch(torch.ones(1, 3, dtype=torch.bool), torch.tensor([1.0], dtype=torch.float64),
                       torch.zeros(1, 3, dtype=torch.float64), sampler_logprobs=sampler)
    out = fn(lp, batch, num_valid_tokens=3, num_sequences=1)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-5 / 3, abs=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1 / 3, -4 / 3]], dtype=torch.float64))
    assert out.metrics["mismatch/capped_fraction"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match=r"tis_cap_min=3.0 must be >= 0 and < tis_cap=2.0"):
        ClippedSurrogate(tis_cap=2.0, tis_cap_min=3.0)
    with pytest.raises(ValueError, match=r"TruncatedIS needs a bound"):
        TruncatedIS(None)
    assert "tis_cap_min" not in repr(ClippedSurrogate(tis_cap=2.0))
    assert str(TruncatedIS(2.0, cap_min=0.5)) == "tis_cap=2.0, tis_cap_min=0.5"


# -- Clip-Cov and KL-Cov ------------------------------------------------------------------------------------

from grpo_engine.losses import ClipCov, KLCov  # noqa: E402

# the cases, and the same with advantages times 4 (covariances up to ~10: some inside Clip-Cov's (1, 5))
COV_CASES = CASES + [(name + "-wide", lp, mask, 4 * adv, old, ref) for name, lp, mask, adv, old, ref in CASES]


def covariances(lp, adv, mask):
    """{(i, t): (A_i - mean A)(log π_it - mean log π)} over the valid tokens (arXiv 2505.22617); loops."""
    lp, adv, mask = lists(lp, adv, mask)
    valid = [(i, t) for i, row in enumerate(mask) for t, keep in enumerate(row) if keep]
    mean_a = sum(adv[i] for i, _ in valid) / len(valid)
    mean_l = sum(lp[i][t] for i, t in valid) / len(valid)
    return {(i, t): (adv[i] - mean_a) * (lp[i][t] - mean_l) for i, t in valid}


def cov_reference(lp, old, adv, mask, *, eps_low=0.2, eps_high=0.2, cut=(), penalised=(), coef=1.0):
    """Token-mean clipped surrogate; tokens in ``cut`` add nothing (Clip-Cov), tokens in ``penalised`` add
    coef·|log π_θ - log π_old| (KL-Cov, gradient coef·sign). Loops, float64; also the PPO-clipped set."""
    lp, old, adv, mask = lists(lp, old, adv, mask)
    n_tok = sum(sum(row) for row in mask)
    loss, grad, clipped = 0.0, [[0.0] * len(row) for row in mask], set()
    for i, row in enumerate(mask):
        for t, keep in enumerate(row):
            if not keep:
                continue
            x = lp[i][t] - old[i][t]
            rho, slope = E(clamp(x, -20, 20)), (E(x) if abs(x) <= 20 else 0.0)
            c = clamp(rho, 1 - eps_low, 1 + eps_high)
            if c * adv[i] < rho * adv[i]:
                clipped.add((i, t))
            if (i, t) not in cut:
                loss -= min(rho * adv[i], c * adv[i]) / n_tok
                grad[i][t] = (-adv[i] * slope if rho * adv[i] <= c * adv[i] else 0.0) / n_tok
            if (i, t) in penalised:
                loss += coef * abs(x) / n_tok
                grad[i][t] += coef * math.copysign(1.0, x) / n_tok
    return loss, torch.tensor(grad, dtype=torch.float64), clipped


def test_covariance_hand_values():
    """Two rows, A = [1, -1], log π = [[-1, -3], [-1, ·]]: over the 3 valid tokens mean A = 1/3 and
    mean log π = -5/3. Cov = (2/3)(2/3), (2/3)(-4/3), (-4/3)(2/3) = [4/9, -8/9 | -8/9]."""
    from grpo_engine.losses.covariance import token_covariance

    cov = token_covariance(torch.tensor([[-1.0, -3.0], [-1.0, 0.0]], dtype=torch.float64),
                           torch.tensor([1.0, -1.0], dtype=torch.float64),
                           torch.tensor([[1, 1], [1, 0]]).bool())
    torch.testing.assert_close(cov, torch.tensor([[4 / 9, -8 / 9], [-8 / 9, -math.inf]], dtype=torch.float64))


@pytest.mark.parametrize("case", COV_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("ratio", [2e-4, 0.3, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_clip_cov_matches_naive_reference(case, ratio, seed):
    """Clip-Cov: the candidates (valid, not PPO-clipped, 1 < Cov < 5, in row-major order), a random
    max(1, ⌊r·N⌋) of them by torch.randperm after the same seed, lose their policy term."""
    _, lp, mask, adv, old, ref = case
    cov = covariances(lp, adv, mask)
    *_, clipped = cov_reference(lp, old, adv, mask)
    candidates = [key for key, c in sorted(cov.items()) if 1 < c < 5 and key not in clipped]
    torch.manual_seed(seed)
    order = torch.randperm(len(candidates)).tolist()
    cut = {candidates[j] for j in order[:max(1, int(ratio * len(cov)))]}
    want, want_grad, _ = cov_reference(lp, old, adv, mask, cut=cut)
    fn = ClippedSurrogate(aggregation="token", clip_cov_ratio=ratio)
    for truncated in (None, [True] * mask.shape[0]):
        torch.manual_seed(seed)
        out, x = run(fn, case, truncated=truncated)
        assert out.loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
        torch.testing.assert_close(x.grad, want_grad, rtol=1e-10, atol=1e-12)
        assert out.metrics["clip_cov_fraction"].item() == pytest.approx(len(cut) / len(cov))
    if case[0] == "random-wide" and ratio == 1.0:
        assert cut  # the test cuts a token somewhere


@pytest.mark.parametrize("case", COV_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("ratio, coef", [(2e-4, 1.0), (0.25, 0.1), (1.0, 2.0)])
@pytest.mark.parametrize("unclipped", [False, True])
def test_kl_cov_matches_naive_reference(case, ratio, coef, unclipped):
    """KL-Cov: the max(1, ⌊k·N⌋) tokens of largest Cov get coef·|log π_θ - log π_old|; ``unclipped`` is the
    paper's and verl's surrogate (no PPO clip: ε_low = 1, ε_high = 1e9)."""
    _, lp, mask, adv, old, ref = case
    cov = covariances(lp, adv, mask)
    top = set(sorted(cov, key=lambda key: -cov[key])[:max(1, int(ratio * len(cov)))])
    eps = dict(eps_low=1.0, eps_high=1e9) if unclipped else {}
    want, want_grad, _ = cov_reference(lp, old, adv, mask, penalised=top, coef=coef, **eps)
    clip = dict(clip_eps_low=1.0, clip_eps_high=1e9) if unclipped else {}
    fn = ClippedSurrogate(aggregation="token", kl_cov_ratio=ratio, kl_cov_coef=coef, **clip)
    for truncated in (None, [True] * mask.shape[0]):
        out, x = run(fn, case, truncated=truncated)
        assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
        assert out.loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
        torch.testing.assert_close(x.grad, want_grad, rtol=1e-10, atol=1e-12)
        assert out.metrics["kl_cov_fraction"].item() == pytest.approx(len(top) / len(cov))


def test_cov_terms_errors_and_repr():
    with pytest.raises(ValueError, match=r"clip_cov_ratio=0 must be in \(0, 1\]"):
        ClippedSurrogate(clip_cov_ratio=0)
    with pytest.raises(ValueError, match=r"kl_cov_coef=0.0 must be > 0"):
        KLCov(coef=0.0)
    with pytest.raises(ValueError, match=r"ClipCov: low=5 must be < high=1"):
        ClipCov(low=5, high=1)
    assert "cov" not in repr(ClippedSurrogate())
    assert ClippedSurrogate(kl_cov_ratio=0.1, clip_cov_ratio=0.1).requires.zero_advantage_rows


# -- Skywork-OR1's adaptive entropy bonus -------------------------------------------------------------------

from grpo_engine.losses import AdaptiveEntropyBonus  # noqa: E402
from tests.test_loss_family import trl_loss  # noqa: E402


def adaptive_reference(entropies, *, target, coef, delta, low, high):
    """Skywork-OR1 §3.2 with TRL's timing, loops: the α applied at each step and c after it."""
    applied, last = [], math.inf
    for h in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(max(coef + (delta if h <= target else -delta), low), high)
        last = h
    return applied, coef


def test_adaptive_entropy_coefficient_trajectory():
    """target 0.2, Δ 0.05, c in [0, 0.12]: entropies 0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.2.
    c: 0 -> .05 -> .10 -> .12 (capped) -> .12 -> .07 -> .02 -> .07 (0.2 <= target counts as low).
    α: 0 (nothing measured yet), .05, .10, .12, .12 (the last step was low), 0 (high), 0."""
    bonus = AdaptiveEntropyBonus(entropy_target=0.2, coef=0.0, delta=0.05, coef_max=0.12)
    entropies = [0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.2]
    applied = []
    for h in entropies:
        applied.append(bonus.applied_coef)
        bonus.update(h)
    assert applied == pytest.approx([0.0, 0.05, 0.10, 0.12, 0.12, 0.0, 0.0])
    assert bonus.coef == pytest.approx(0.07)
    want, final = adaptive_reference(entropies, target=0.2, coef=0.0, delta=0.05, low=0.0, high=0.12)
    assert applied == pytest.approx(want) and bonus.coef == pytest.approx(final)
    saved = bonus.state_dict()
    fresh = AdaptiveEntropyBonus(entropy_target=0.2, coef=0.0, delta=0.05, coef_max=0.12)
    fresh.load_state_dict(saved)
    assert (fresh.coef, fresh.last_entropy, repr(fresh)) == (bonus.coef, bonus.last_entropy, repr(bonus))


def adaptive_case(seed):
    _, lp, mask, adv, old, ref = CASES[seed % 2]
    g = torch.Generator().manual_seed(seed)
    scale = (0.2, 0.2, 0.8, 0.2, 0.8)[seed]  # token-mean entropies about 0.1, 0.1, 0.4, 0.1, 0.4
    ent = torch.where(mask, scale * torch.rand(mask.shape, generator=g, dtype=torch.float64), 0.0)
    return torch.where(mask, lp.detach(), 0.0), mask, adv, torch.where(mask, old, 0.0), ent


def ours_adaptive_step(bonus, lp, mask, adv, old, ent):
    fn = ClippedSurrogate(aggregation="token", terms=(bonus,))
    x, e = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    batch = MicroBatch(mask, adv, old, entropy=e)
    out = fn(x, batch, num_valid_tokens=int(mask.sum()), num_sequences=mask.shape[0])
    out.loss.backward()
    metrics = {k: v.item() for k, v in out.metrics.items()}
    bonus.on_step_end(None, None, None, metrics=metrics)
    return out.loss.detach(), x.grad, e.grad, metrics


@pytest.mark.parametrize("target", [0.15, 0.2, 0.3])
def test_adaptive_entropy_matches_naive_reference(target):
    """Five steps: each loss is the clipped token mean minus α_k · (token-mean entropy); ∂/∂H = -α_k/N per
    valid token; α and c follow the loop."""
    bonus = AdaptiveEntropyBonus(entropy_target=target, coef=0.02, delta=0.01)
    plain = ClippedSurrogate(aggregation="token")
    seen = []
    for step in range(5):
        lp, mask, adv, old, ent = adaptive_case(step)
        alpha = bonus.applied_coef
        loss, _, ent_grad, metrics = ours_adaptive_step(bonus, lp, mask, adv, old, ent)
        base = plain(lp, MicroBatch(mask, adv, old), num_valid_tokens=int(mask.sum()), num_sequences=8).loss
        mean_h = sum(sum(r) for r in lists(ent)[0]) / int(mask.sum())
        want, _ = adaptive_reference(seen + [mean_h], target=target, coef=0.02, delta=0.01, low=0.0, high=1.0)
        assert alpha == pytest.approx(want[-1])
        assert loss.item() == pytest.approx(base.item() - alpha * mean_h, rel=1e-12, abs=1e-12)
        torch.testing.assert_close(ent_grad, torch.where(mask, -alpha / int(mask.sum()), 0.0).double())
        assert metrics["entropy"] == pytest.approx(mean_h) and metrics["entropy_coef"] == bonus.applied_coef
        seen.append(mean_h)
    assert any(want)  # the bonus was on at some step


def test_adaptive_entropy_equals_trl_over_steps():
    """TRL 1.16 ``use_adaptive_entropy=True`` (``entropy_coef`` 0.02, ``entropy_coef_delta`` 0.01,
    ``entropy_target`` 0.2; one micro-batch a step) for five steps: the same loss, the same gradients
    (log-probs and entropies) and the same coefficient after each step."""
    state = dict(coef=0.02, last=math.inf, window=None, ent=None)

    def slot(name):
        return property(lambda self: state[name], lambda self, value: state.__setitem__(name, value))

    class Trainer(trl_grpo.GRPOTrainer):
        use_adaptive_entropy = property(lambda self: True)
        _entropy_bonus_enabled = property(lambda self: True)
        entropy_coef, _last_world_entropy, _entropy_window_stats = slot("coef"), slot("last"), slot("window")

        @property
        def _get_per_token_logps_and_entropies(self):
            inner = self.__dict__["_get_per_token_logps_and_entropies"]
            return lambda *a, **k: (inner(*a, **k)[0], state["ent"], None)

    bonus = AdaptiveEntropyBonus(entropy_target=0.2, coef=0.02, delta=0.01)
    for step in range(5):
        lp, mask, adv, old, ent = adaptive_case(step)
        loss, grad, ent_grad, _ = ours_adaptive_step(bonus, lp, mask, adv, old, ent)
        x, state["ent"] = lp.clone().requires_grad_(), ent.clone().requires_grad_()
        trl = trl_loss("dapo", x, mask, adv, old, trainer_cls=Trainer, entropy_target=0.2,
                       entropy_coef_delta=0.01, entropy_coef_min=0.0, entropy_coef_max=1.0)
        trl.backward()
        torch.testing.assert_close(loss, trl.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ent_grad, state["ent"].grad, rtol=1e-10, atol=1e-12)
        assert bonus.coef == pytest.approx(state["coef"], abs=1e-12)
        assert bonus.last_entropy == pytest.approx(state["last"], rel=1e-12)


def test_adaptive_entropy_errors():
    with pytest.raises(ValueError, match=r"delta=0 must be > 0.*coef=2.0 must lie in \[coef_min, coef_max\]"):
        AdaptiveEntropyBonus(entropy_target=0.2, coef=2.0, delta=0)
    bonus = AdaptiveEntropyBonus(entropy_target=0.2)
    assert ClippedSurrogate(terms=(bonus,)).requires.entropy
    metrics = {}
    bonus.on_step_end(None, None, None, metrics=metrics)  # nothing measured: no change
    assert bonus.last_entropy == math.inf and metrics["entropy_coef"] == 0.0


# -- TR-DPO reference sync ----------------------------------------------------------------------------------

from grpo_engine.memory.apply import ReferencePolicy  # noqa: E402
from grpo_engine.memory.plan import LoRA, MemoryPlan  # noqa: E402
from grpo_engine.ref_sync import ReferenceSync  # noqa: E402


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def nudge(policy, step):
    with torch.no_grad():
        for k, p in enumerate(policy.parameters()):
            p.add_(0.1 * math.sin(step + k) * torch.ones_like(p) + 0.01 * step)


def mix_reference(ref, live, alpha):
    """θ_ref ← α θ + (1 - α) θ_ref, element by element (TR-DPO, arXiv 2404.09656 eq. 5)."""
    return [[alpha * x + (1 - alpha) * r for r, x in zip(rs, xs)] for rs, xs in zip(ref, live)]


def flat(module):
    return [p.detach().flatten().tolist() for p in module.parameters()]


@pytest.mark.parametrize("alpha", [0.6, 1.0, 0.05])
def test_reference_mix_equals_loop_and_trl(alpha):
    policy = tiny_policy()
    reference = ReferencePolicy(policy, MemoryPlan())
    nudge(policy, 1)
    with reference.active() as ref_model:
        before = flat(ref_model)
        trl_ref = [p.detach().clone() for p in ref_model.parameters()]
    want = mix_reference(before, flat(policy), alpha)
    reference.mix(alpha)
    with reference.active() as ref_model:
        got = flat(ref_model)
        for a, b in zip(got, want):
            assert a == pytest.approx(b, rel=1e-14, abs=1e-15)
    copy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    with torch.no_grad():
        for p, value in zip(copy.parameters(), trl_ref):
            p.copy_(value)
    pytest.importorskip("trl.trainer.callbacks").SyncRefModelCallback._sync_target_model(policy, copy, alpha)
    assert flat(copy) == got  # TRL's own update, bit for bit
    assert all(not p.requires_grad for p in ref_model.parameters())


def test_reference_sync_every_tau_steps_and_resume():
    """τ = 2, α = 0.5, six steps: the reference moves after steps 2, 4 and 6 only; its checkpoint state
    restores the moved weights into a new run's reference at train start."""
    policy = tiny_policy()
    reference = ReferencePolicy(policy, MemoryPlan())
    trainer = SimpleNamespace(reference=reference)
    sync = ReferenceSync(every_steps=2, alpha=0.5)
    sync.on_init(trainer, None, None)
    assert sync.state_dict() == {"reference": None}  # nothing moved yet: nothing to keep
    want = flat(policy)
    for step in range(1, 7):
        nudge(policy, step)
        metrics = {}
        sync.on_step_end(trainer, SimpleNamespace(step=step), None, metrics=metrics)
        if step % 2 == 0:
            want = mix_reference(want, flat(policy), 0.5)
        assert ("reference/synced" in metrics) == (step % 2 == 0)
        with reference.active() as ref_model:
            for a, b in zip(flat(ref_model), want):
                assert a == pytest.approx(b, rel=1e-13)
    saved = sync.state_dict()
    fresh_policy = tiny_policy(seed=1)
    fresh = SimpleNamespace(reference=ReferencePolicy(fresh_policy, MemoryPlan()))
    resumed = ReferenceSync(every_steps=2, alpha=0.5)
    resumed.load_state_dict(saved)
    resumed.on_init(fresh, None, None)
    resumed.on_train_start(fresh, None, None)
    with fresh.reference.active() as ref_model, reference.active() as old_model:
        assert flat(ref_model) == flat(old_model)


def test_reference_sync_errors():
    with pytest.raises(ValueError, match=r"every_steps=0 must be an int >= 1.*alpha=1.5 must be in \(0, 1\]"):
        ReferenceSync(every_steps=0, alpha=1.5)
    with pytest.raises(ValueError, match=r"ReferenceSync: this run has no reference policy"):
        ReferenceSync().on_init(SimpleNamespace(reference=None), None, None)
    lora = ReferencePolicy(tiny_policy(), MemoryPlan(lora=LoRA()))
    with pytest.raises(ValueError, match=r"under LoRA the reference is the policy with its adapters off"):
        ReferenceSync().on_init(SimpleNamespace(reference=lora), None, None)
    assert repr(ReferenceSync(64, 1.0)) == "ReferenceSync(every_steps=64, alpha=1.0)"


# -- By name in a run file -----------------------------------------------------------------------------------

def test_run_file_names_every_new_piece():
    """A YAML run file reaches each piece by import path and keywords; GDPO through reward_normalize /
    reward_eps (a WeightedSum), the rest as components."""
    import yaml

    from grpo_engine.advantages import MaxRL
    from grpo_engine.spec import RunSpec, build, rewards_of

    text = """
model: some/model
train_prompts: {function: grpo_engine.data.load_gsm8k, path: x.jsonl}
rewards: [{class: grpo_engine.rewards.MathAccuracy}, {class: grpo_engine.rewards.BoxedFormat, weight: 0.1}]
reward_normalize: each
reward_eps: 1.0e-4
advantage: {class: grpo_engine.advantages.MaxRL}
loss: {class: grpo_engine.losses.ClippedSurrogate, aggregation: token, kl_coef: 0.01, kl_ratio_weighted: true,
       off_policy_mask_threshold: 0.5, tis_cap: 5.0, tis_cap_min: 0.5, tis_mode: token_mask,
       clip_cov_ratio: 2.0e-4, kl_cov_ratio: 2.0e-4, kl_cov_coef: 1.0}
callbacks: [{class: grpo_engine.ref_sync.ReferenceSync, every_steps: 64, alpha: 0.6}]
"""
    spec = RunSpec.model_validate(yaml.safe_load(text))
    combined = rewards_of(spec)
    assert isinstance(combined, WeightedSum) and (combined.normalize, combined.eps) == ("each", 1e-4)
    assert isinstance(build(spec.advantage), MaxRL)
    loss = build(spec.loss)
    kinds = [type(t).__name__ for t in loss._terms]
    assert kinds == ["TruncatedIS", "OffPolicySequenceMask", "ClipCov", "KLCov", "RatioWeightedKL"]
    assert isinstance(build(spec.callbacks[0]), ReferenceSync)
    plain = RunSpec.model_validate({**yaml.safe_load(text), "reward_normalize": "after_sum",
                                    "reward_eps": 1e-6})
    assert isinstance(rewards_of(plain), list)


def test_run_file_lists_the_adaptive_entropy_bonus_once_under_callbacks():
    """``AdaptiveEntropyBonus`` is a callback and a loss term, one object: listed under ``callbacks``, the
    run's loss gets that same object among its terms (a ClippedSurrogate when the file names no loss);
    a loss that takes no terms is refused by name."""
    import yaml

    from grpo_engine.losses import ClippedSurrogate
    from grpo_engine.spec import BuildError, RunSpec, build, loss_of

    text = """
model: some/model
train_prompts: {function: grpo_engine.data.load_gsm8k, path: x.jsonl}
rewards: [{class: grpo_engine.rewards.MathAccuracy}]
loss: {class: grpo_engine.losses.ClippedSurrogate, aggregation: token, kl_coef: 0.01}
callbacks: [{class: grpo_engine.losses.AdaptiveEntropyBonus, entropy_target: 0.2,
             delta: 0.01},
            {class: grpo_engine.ref_sync.ReferenceSync, every_steps: 64, alpha: 0.6}]
"""
    data = yaml.safe_load(text)
    spec = RunSpec.model_validate(data)
    callbacks = [build(c) for c in spec.callbacks]
    loss = loss_of(spec, callbacks)
    assert loss.terms == (callbacks[0],) and loss.terms[0] is callbacks[0] and loss.aggregation == "token"
    assert (callbacks[0].entropy_target, callbacks[0].delta, loss.kl_coef) == (0.2, 0.01, 0.01)
    no_loss = RunSpec.model_validate({k: v for k, v in data.items() if k != "loss"})
    assert loss_of(no_loss, callbacks) == ClippedSurrogate(terms=(callbacks[0],))
    assert loss_of(no_loss, callbacks[1:]) is None  # no term among them: the trainer's default loss
    gspo = RunSpec.model_validate({**data, "loss": {"class": "grpo_engine.losses.GSPO"}})
    with pytest.raises(BuildError, match=r"\['AdaptiveEntropyBonus'\] are loss terms too, and GSPO takes no"):
        loss_of(gspo, callbacks)
