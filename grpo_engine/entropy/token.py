"""Token entropy of the policy: the reductions live in :mod:`grpo_engine.ops.tokens` (re-exported).

The entropies come from the log-prob pass (``completion_logprobs(..., with_entropy=True)``), the
same chunked lm_head projection that gives the log-probs, at the sampling temperature.
"""

from grpo_engine.ops.tokens import group_token_entropy, high_entropy_mask, token_entropy_mean

__all__ = ["token_entropy_mean", "group_token_entropy", "high_entropy_mask"]
