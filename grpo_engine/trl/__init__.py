"""TRL's entry point: ``from grpo_engine.trl import GRPOConfig, GRPOTrainer`` runs a TRL 1.16 GRPO script
with only its import line changed.

- :class:`~grpo_engine.trl.config.GRPOConfig`: every field of TRL 1.16's ``trl.GRPOConfig`` (its own and
  those of ``transformers.TrainingArguments``) by name, with TRL's defaults resolved as TRL resolves them.
- :class:`~grpo_engine.trl.trainer.GRPOTrainer`: TRL's constructor; it maps the config onto the native
  :class:`grpo_engine.GRPOTrainer` (:mod:`grpo_engine.trl.mapping`), which keeps its own defaults.

A field set to a value other than TRL's default that has no equivalent here raises one ``TRLSettingError``
naming each such field, why, and the nearest setting. trl itself is never imported. docs/from_trl.md lists
every default that differs between this entry and the native API.
"""

from grpo_engine.trl.config import GRPOConfig
from grpo_engine.trl.errors import TRLSettingError
from grpo_engine.trl.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "TRLSettingError"]
