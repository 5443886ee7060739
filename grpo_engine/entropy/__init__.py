"""Uncertainty estimators (``EntropyEstimator``): per-group semantic entropy from answer clusters.

    from grpo_engine.entropy import SemanticEntropy
    trainer = GRPOTrainer(..., entropy=SemanticEntropy(normalize=True), advantage=EntropyScaled())
"""

from grpo_engine.entropy.semantic import SemanticEntropy, cluster_answers, semantic_entropy, sequence_log_likelihood

__all__ = ["SemanticEntropy", "cluster_answers", "semantic_entropy", "sequence_log_likelihood"]
