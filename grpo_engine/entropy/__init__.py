"""Entropy as a signal: semantic entropy of a group's answers, token entropy, and what they steer.

    from grpo_engine.data import InformativeCurriculum
    from grpo_engine.entropy import AdaptiveTemperature, SemanticEntropy
    trainer = GRPOTrainer(model, rewards, InformativeCurriculum(prompts, batch_size=4),
                          entropy=SemanticEntropy(normalize=True), advantage=EntropyScaled(),
                          callbacks=[AdaptiveTemperature()])
"""

from grpo_engine.entropy.control import AdaptiveTemperature, collapsed_fraction, collapsed_groups
from grpo_engine.entropy.semantic import (
    SemanticEntropy,
    cluster_answers,
    semantic_entropy,
    sequence_log_likelihood,
)
from grpo_engine.entropy.token import group_token_entropy, high_entropy_mask, token_entropy_mean

__all__ = [
    "SemanticEntropy",
    "cluster_answers",
    "semantic_entropy",
    "sequence_log_likelihood",
    "token_entropy_mean",
    "group_token_entropy",
    "high_entropy_mask",
    "AdaptiveTemperature",
    "collapsed_groups",
    "collapsed_fraction",
]
