"""The sampling settings a sampler passed to ``GRPOTrainer(sampler=...)`` shares with the run's GRPOConfig.

``max_prompt_tokens``, ``max_completion_tokens``, ``temperature``, ``top_p`` and ``top_k`` live on both:
the sampler draws with its own, the trainer reads the config's (the overlong-prompt check, evaluation's
length, the temperature it samples and scores at, which ``AdaptiveTemperature`` then moves).
:func:`agreed_config` makes them one value each when the trainer is built, never one silently over the
other:

- the same value on both sides: nothing to do;
- set on one side only (the config's ``model_fields_set``; the sampler's ``settings_given``, which
  :func:`records_settings` keeps for ``HFSampler`` and the vLLM samplers): that value holds on both sides
  (logger ``grpo_engine.sampling.settings``, level INFO), so the defaults nobody chose never clash;
- set on both sides, differently: one ``ValueError`` lists every such setting with both values.

A sampler without ``settings_given`` (your own class) counts every one of these attributes it has as
set; a ``ToolSampler`` holds them on the sampler it wraps (``base``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["SETTINGS", "agreed_config", "records_settings"]

logger = logging.getLogger(__name__)

SETTINGS = ("max_prompt_tokens", "max_completion_tokens", "temperature", "top_p", "top_k")

C = TypeVar("C")


def records_settings(init: Callable[..., None]) -> Callable[..., None]:
    """Wraps a sampler's ``__init__`` (keyword-only settings) to keep which of :data:`SETTINGS` the caller
    passed in ``self.settings_given``; the others hold the sampler's defaults."""

    @functools.wraps(init)
    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.settings_given = frozenset(SETTINGS).intersection(kwargs)

    return recording


def agreed_config(sampler: Any, config: C) -> C:
    """The run's config once ``sampler`` (passed to the trainer; None or a group filter: unchanged) and
    ``config`` (a ``GRPOConfig``) agree on :data:`SETTINGS` (module docstring): a setting only the sampler
    was given comes into the returned config, one only the config was given is set on the sampler.

    Raises:
        ValueError: settings given on both sides with different values, every one of them named.

    Example:
        >>> from types import SimpleNamespace
        >>> from grpo_engine.config import GRPOConfig
        >>> sampler = SimpleNamespace(max_completion_tokens=64, temperature=0.7)  # a sampler of your own
        >>> config = agreed_config(sampler, GRPOConfig(temperature=0.7))
        >>> config.max_completion_tokens, config.temperature
        (64, 0.7)
    """
    holder = getattr(sampler, "base", sampler)  # a ToolSampler's settings are its single-turn sampler's
    present = [name for name in SETTINGS if hasattr(holder, name)]
    given = getattr(holder, "settings_given", frozenset(present))
    chosen = config.model_fields_set  # type: ignore[attr-defined]
    clashes, to_config, to_sampler = [], {}, {}
    for name in present:
        ours, theirs = getattr(config, name), getattr(holder, name)
        if ours == theirs:
            continue
        if name in chosen and name in given:
            clashes.append(f"  - {name}: {type(holder).__name__}({name}={theirs!r}), "
                           f"GRPOConfig({name}={ours!r})")
        elif name in chosen:
            to_sampler[name] = ours
        else:
            to_config[name] = theirs
    if clashes:
        raise ValueError(f"the sampler passed to GRPOTrainer and its GRPOConfig set {len(clashes)} sampling "
                         "setting(s) differently:\n" + "\n".join(clashes) + "\nset each in one place: in "
                         "the sampler (leave it out of GRPOConfig) or in GRPOConfig (leave it out of the "
                         "sampler, which then takes the config's)")
    for name, value in to_sampler.items():
        logger.info("the sampler takes GRPOConfig's %s=%r (it was built without one)", name, value)
        setattr(holder, name, value)
    if not to_config:
        return config
    logger.info("GRPOConfig takes the sampler's %s (they were left out of the config)",
                ", ".join(f"{name}={value!r}" for name, value in to_config.items()))
    kept = {name: getattr(config, name) for name in chosen}
    return type(config)(**kept, **to_config)
