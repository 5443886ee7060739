"""Policy objectives of the GRPO family, built from small parts.

``ClippedSurrogate`` (GRPO, DAPO, Dr. GRPO, INTELLECT-2's δ) composes the terms of ``terms.py``
(``MaskTruncated``, ``TruncatedIS``, ``HighEntropyTokens``, ``KLPenalty``, ``EntropyBonus``) and one of
the three aggregations of ``aggregation.py``; ``GSPO`` clips a sequence-level ratio (arXiv
2507.18071); ``CISPO`` clips a stop-gradient importance weight (arXiv 2506.13585); ``SAPO`` replaces
the clip by a soft gate (arXiv 2511.20347); ``GMPO`` takes the geometric mean of clipped token ratios
(arXiv 2507.20673); ``DPPO`` masks tokens whose probability leaves a TV or KL trust region (arXiv
2602.04879); ``LUSPO`` weights GSPO's sequence losses by their lengths (arXiv 2602.05261); ``VESPO``
weights REINFORCE by a Gamma kernel of the sequence ratio (arXiv 2602.10693). The KL estimators
``kl_k1`` / ``kl_k2`` / ``kl_k3`` live in :mod:`grpo_engine.ops.kl` (re-exported).
"""

from grpo_engine.losses.adaptive_entropy import AdaptiveEntropyBonus
from grpo_engine.losses.aggregation import AGGREGATIONS, aggregate
from grpo_engine.losses.cispo import CISPO
from grpo_engine.losses.clipped import ClippedSurrogate
from grpo_engine.losses.covariance import ClipCov, KLCov
from grpo_engine.losses.dppo import DPPO
from grpo_engine.losses.gmpo import GMPO
from grpo_engine.losses.gspo import GSPO
from grpo_engine.losses.luspo import LUSPO
from grpo_engine.losses.sapo import SAPO
from grpo_engine.losses.terms import (
    EntropyBonus,
    HighEntropyTokens,
    KLPenalty,
    MaskTruncated,
    OffPolicySequenceMask,
    RatioWeightedKL,
    TruncatedIS,
    icepop,
)
from grpo_engine.losses.vespo import VESPO
from grpo_engine.ops.kl import KL_ESTIMATORS, kl_estimator, kl_k1, kl_k2, kl_k3

__all__ = ["ClippedSurrogate", "GSPO", "CISPO", "SAPO", "GMPO", "DPPO", "LUSPO", "VESPO",
           "MaskTruncated", "TruncatedIS", "HighEntropyTokens", "KLPenalty", "EntropyBonus",
           "OffPolicySequenceMask", "RatioWeightedKL", "icepop", "ClipCov", "KLCov",
           "AdaptiveEntropyBonus",
           "AGGREGATIONS", "aggregate", "KL_ESTIMATORS", "kl_estimator", "kl_k1", "kl_k2", "kl_k3"]
