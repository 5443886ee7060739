"""Policy objectives of the GRPO family and the KL estimators they use.

``ClippedSurrogate`` covers GRPO (sequence aggregation, k3 KL), DAPO (token aggregation,
asymmetric clip) and Dr. GRPO (constant aggregation); ``kl_k1``/``kl_k2``/``kl_k3`` are
Schulman's per-token estimators of KL(π_θ ‖ π_ref).
"""

from grpo_engine.losses.clipped import ClippedSurrogate
from grpo_engine.losses.kl import kl_k1, kl_k2, kl_k3

__all__ = ["ClippedSurrogate", "kl_k1", "kl_k2", "kl_k3"]
