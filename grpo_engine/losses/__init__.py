"""Policy objectives of the GRPO family and the KL estimators they use.

``ClippedSurrogate`` covers GRPO (sequence aggregation, k3 KL), DAPO (token aggregation,
asymmetric clip, overlong filtering), Dr. GRPO (constant aggregation) and INTELLECT-2's
two-sided clip (``delta``); ``GSPO`` clips a sequence-level ratio (Qwen, arXiv 2507.18071);
``CISPO`` clips a stop-gradient importance weight (MiniMax-M1, arXiv 2506.13585).
``kl_k1``/``kl_k2``/``kl_k3`` are Schulman's per-token estimators of KL(π_θ ‖ π_ref), also
reachable by name through ``kl_estimator``.
"""

from grpo_engine.losses.cispo import CISPO
from grpo_engine.losses.clipped import ClippedSurrogate
from grpo_engine.losses.gspo import GSPO
from grpo_engine.losses.kl import KL_ESTIMATORS, KLRewardPenalty, kl_estimator, kl_k1, kl_k2, kl_k3

__all__ = ["ClippedSurrogate", "GSPO", "CISPO", "KL_ESTIMATORS", "KLRewardPenalty", "kl_estimator", "kl_k1", "kl_k2",
           "kl_k3"]
