"""Pure helpers below every component: answer extraction and equivalence, reward-group statistics,
masked token reductions, KL estimators. They import nothing of grpo_engine but ``types``."""
