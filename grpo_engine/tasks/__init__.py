"""Public task suites as prompts and rewards; today reasoning-gym's families (the extra ``[tasks]``:
``pip install 'grpo-engine[tasks]'``).

- :func:`reasoning_gym_task`: seeded, disjoint training and held-out prompts of a family, or of several
  families weighted (reasoning-gym's composite dataset).
- :class:`ReasoningGymScore`: the family's own scorer as a reward (partial credit where the family gives
  it; None on a prompt of another source).
- :class:`DifficultyCurriculum`: a prompt source whose difficulty level (the family's curriculum) rises
  when the mean group accuracy over a window passes a threshold.

Example:
    >>> from grpo_engine.tasks import ReasoningGymScore, reasoning_gym_task
    >>> train, test = reasoning_gym_task("leg_counting", num_train=4, num_test=2, seed=0)
    >>> test[0].target == test[0].metadata["entry"]["answer"]
    True
"""

from grpo_engine.tasks.curriculum import DifficultyCurriculum
from grpo_engine.tasks.reasoning_gym import (
    INSTALL_HINT,
    ReasoningGymScore,
    reasoning_gym_task,
    require_reasoning_gym,
)

__all__ = ["INSTALL_HINT", "DifficultyCurriculum", "ReasoningGymScore", "reasoning_gym_task",
           "require_reasoning_gym"]
