"""reasoning-gym's task families as prompts and as a reward (the optional extra ``[tasks]``).

reasoning-gym generates seeded problems in about a hundred families, each with a difficulty
configuration and its own scorer. They are used here as the package uses them itself, nothing re-done:

- Prompts: ``reasoning_gym.create_dataset(family, seed=, size=, **config)``, or for several families,
  weighted, its composite dataset (``reasoning_gym.composite``, specs of ``name``, ``weight``,
  ``config``). An entry's ``question`` is the user turn after one of the package's
  ``reasoning_gym.utils.SYSTEM_PROMPTS`` (``"default"`` unless told), its ``answer`` the target, and
  the whole entry travels in ``Prompt.metadata["entry"]`` with the family's name and config.
- Splits: the held-out split is the first ``num_test`` distinct questions of the seeded stream, the
  training split the next ``num_train`` distinct questions not among them. Distinct by question text,
  because seeds are not splits: most families draw item ``i`` from ``Random(seed + i)``, so item ``i``
  of seed 1 is item ``i + 1`` of seed 0, and a generator may repeat a problem under one seed too.
- Reward: :class:`ReasoningGymScore`, the package's ``extract_answer`` (the last
  ``<answer>...</answer>``) scored by the family's ``score_answer(answer, entry)``, in [0, 1] with
  the family's partial credit; None (does not apply) on a prompt of another source.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor

from grpo_engine.data.errors import DataError
from grpo_engine.ops.answers import final_answer
from grpo_engine.rewards.base import Reward, check_scores
from grpo_engine.types import Prompt

__all__ = ["INSTALL_HINT", "ReasoningGymScore", "reasoning_gym_task", "require_reasoning_gym"]

INSTALL_HINT = "pip install 'grpo-engine[tasks]'"
_MAX_GROWTH = 8  # draws at most 8 x the questions asked for before calling a configuration too narrow


def require_reasoning_gym() -> ModuleType:
    """The ``reasoning_gym`` module.

    Raises:
        ImportError: it is not installed (the message gives the install line).
    """
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(f"reasoning-gym tasks need the package reasoning-gym, which is not installed; "
                          f"install the extra: {INSTALL_HINT}") from exc
    return reasoning_gym


def reasoning_gym_task(family: str | Sequence[Mapping[str, Any]], num_train: int = 1000, num_test: int = 64,
                       *, seed: int = 0, config: Mapping[str, Any] | None = None,
                       system_prompt: str | None = "default") -> tuple[list[Prompt], list[Prompt]]:
    """Disjoint training and held-out prompts of a reasoning-gym family (or several, weighted).

    Args:
        family: a family name (``"leg_counting"``), or for a composite a list of reasoning-gym's dataset
            specs, ``{"name": ..., "weight": ..., "config": {...}}``.
        num_train: training prompts (>= 0).
        num_test: held-out prompts (>= 0); the first distinct questions of the stream.
        seed: the dataset's seed.
        config: the family's configuration fields (e.g. ``{"min_terms": 2}``), not ``seed`` / ``size``.
        system_prompt: a key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` (``"default"``, ``"direct"``...),
            a system message of your own, or None for plain-text prompts (your template's instruction).

    Returns:
        ``(train, test)``: no question in both, none twice.

    Raises:
        DataError: an unknown family or configuration field, or fewer distinct questions than asked for.
        ImportError: reasoning-gym is not installed.

    Example:
        >>> train, test = reasoning_gym_task("chain_sum", 3, 2, seed=0)
        >>> len(train), len(test), train[0].metadata["reasoning_gym"]["family"]
        (3, 2, 'chain_sum')
    """
    rg = require_reasoning_gym()
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DataError(f"{name}={value!r} must be an int >= 0")
    if num_train + num_test == 0:
        raise DataError("num_train + num_test is 0; ask for at least one prompt")
    if isinstance(family, str):
        make = family_factory(family, config, seed)
    else:
        if config:
            raise DataError(f"config={dict(config)!r} applies to one family; give each family of a composite "
                            "its own 'config' in its spec")
        make = _composite_factory(rg, family, seed)
    train, test = draw_splits(make, num_train, num_test)
    system = rg.utils.SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt else None
    return [to_prompt(*row, system) for row in train], [to_prompt(*row, system) for row in test]


Row = tuple[dict[str, Any], str, dict[str, Any]]  # (entry, family, the family's config)
Factory = Callable[[int], Iterable[Row]]  # size -> the rows of a dataset of that size


def family_factory(family: str, config: Mapping[str, Any] | None, seed: int) -> Factory:
    """``size -> (rows of the dataset)``: a function that generates ``size`` entries of ``family`` under
    ``config`` and ``seed``, each with its family and config (a DataError names a bad family or field)."""
    rg = require_reasoning_gym()
    config = dict(config or {})
    check_family(family)
    for key in ("seed", "size"):
        if key in config:
            raise DataError(f"config[{key!r}]={config[key]!r}: the {key} is set by the task (seed=..., "
                            "num_train + num_test); leave it out of config")

    def make(size: int) -> Iterator[Row]:
        dataset = _created(rg, family, {**config, "seed": seed, "size": size})
        fields = config_fields(dataset.config)
        return ((dataset[i], family, fields) for i in range(size))

    return make


def _composite_factory(rg: ModuleType, specs: Sequence[Mapping[str, Any]], seed: int) -> Factory:
    if not specs or any(not isinstance(s, Mapping) or "name" not in s for s in specs):
        raise DataError(f"family={specs!r}: a composite is a non-empty list of specs {{name: ..., weight: "
                        "..., config: {...}}}, e.g. [{name: chain_sum, weight: 2}, {name: gcd, weight: 1}]")
    for spec in specs:
        check_family(spec["name"])
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise DataError(f"the weight of {spec['name']!r} is {weight!r}; a weight is a number > 0")
    parts = [rg.composite.DatasetSpec(s["name"], float(s.get("weight", 1.0)), dict(s.get("config") or {}))
             for s in specs]

    def make(size: int) -> Iterator[Row]:
        composite = _created(rg, "composite", {"seed": seed, "size": size, "datasets": parts})
        fields = {name: config_fields(d.config) for name, d in composite.datasets.items()}
        for i in range(size):
            entry = composite[i]
            name = entry["metadata"]["source_dataset"]
            yield entry, name, fields[name]

    return make


def _created(rg: ModuleType, family: str, config: dict[str, Any]) -> Any:
    try:
        return rg.create_dataset(family, **config)
    except (TypeError, AssertionError, ValueError) as exc:
        shown = {k: v for k, v in config.items() if k not in ("seed", "size")}
        raise DataError(f"reasoning-gym cannot build {family!r} with config {shown}: {exc}; see the fields "
                        f"of its config class (reasoning_gym.factory.DATASETS[{family!r}][1])") from exc


def check_family(family: Any) -> None:
    """DataError unless ``family`` is a registered reasoning-gym family (naming the closest ones)."""
    require_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if not isinstance(family, str) or family not in DATASETS or family == "composite":
        close = difflib.get_close_matches(str(family), list(DATASETS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise DataError(f"family={family!r} is not a reasoning-gym family{hint} (the {len(DATASETS) - 1} "
                        "families: sorted(reasoning_gym.factory.DATASETS))")


def config_fields(config: Any) -> dict[str, Any]:
    """A dataset config's fields as a dict, one level deep (what ``create_dataset`` takes back)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def draw_splits(make: Factory, num_train: int, num_test: int,
                exclude: Collection[str] = ()) -> tuple[list[Row], list[Row]]:
    """The first ``num_test`` distinct questions of ``make(size)`` not in ``exclude``, then the next
    ``num_train`` distinct ones; ``size`` starts at their sum and doubles (a generator anew) while
    duplicates leave too few, up to 8 times the sum.

    Raises:
        DataError: the stream holds fewer distinct questions than asked for.
    """
    wanted = num_train + num_test
    size = wanted
    while True:
        seen, rows = set(exclude), []
        for row in make(size):
            if row[0]["question"] not in seen:
                seen.add(row[0]["question"])
                rows.append(row)
                if len(rows) == wanted:
                    return rows[num_test:], rows[:num_test]
        if size >= _MAX_GROWTH * wanted:
            raise DataError(f"{size} draws gave only {len(rows)} distinct new questions, fewer than "
                            f"num_train + num_test = {wanted}; ask for fewer, or widen the family's config "
                            "(more terms, digits, values)")
        size *= 2


def to_prompt(entry: dict[str, Any], family: str, config: dict[str, Any], system: str | None) -> Prompt:
    """The prompt of one reasoning-gym entry: the question (after ``system``), the answer as target, and
    the entry with its family and config in the metadata (what :class:`ReasoningGymScore` reads)."""
    question = entry["question"]
    content = question if system is None else ({"role": "system", "content": system},
                                               {"role": "user", "content": question})
    answer = entry.get("answer")
    return Prompt(content, target=None if answer is None else str(answer),
                  metadata={"source": f"reasoning_gym/{family}", "entry": entry,
                            "index": entry["metadata"].get("source_index"),
                            "reasoning_gym": {"family": family, "config": config}})


class ReasoningGymScore(Reward):
    """The family's own score of a completion: ``score_answer(extract_answer(completion), entry)``.

    ``extract_answer`` is reasoning-gym's (the last ``<answer>...</answer>``; None without one, which the
    family scores, 0.0 as a rule). The score is in [0, 1], with the family's partial credit (e.g.
    ``chain_sum`` gives an answer that holds the right one ``len(right) / len(answer)``, ``spell_backward``
    the share of letters in place). A prompt not made by :func:`reasoning_gym_task` scores None, "does not
    apply" (NaN in the tensor).

    Args:
        weight, name: as for every :class:`~grpo_engine.rewards.Reward`.
        extract: ``"tags"`` (reasoning-gym's ``extract_answer``), or ``"final"`` for a model that does not
            write tags: ``MathAccuracy``'s rule (the last ``<answer>`` tag, else the last ``\\boxed{}``,
            else the last number; :func:`grpo_engine.ops.answers.final_answer`), scored the same way.

    Raises:
        ValueError: ``extract`` is neither.

    Example:
        >>> train, _ = reasoning_gym_task("chain_sum", 1, 0, seed=0)
        >>> right = f"<answer>{train[0].target}</answer>"
        >>> ReasoningGymScore()([train[0], train[0], Prompt("2+2?")], [right, "no tags", right])
        tensor([1., 0., nan])
    """

    allows_none = True  # WeightedSum: NaN is "does not apply", not an error

    def __init__(self, weight: float = 1.0, name: str | None = None, *,
                 extract: Literal["tags", "final"] = "tags") -> None:
        super().__init__(weight, name)
        require_reasoning_gym()
        if extract not in ("tags", "final"):
            raise ValueError(f"ReasoningGymScore: extract={extract!r} must be 'tags' (reasoning-gym's "
                             "<answer>...</answer>) or 'final' (also a \\boxed{} or the last number)")
        self.extract = extract
        self._datasets: dict[str, Any] = {}

    def check(self, prompt: Prompt) -> str | None:
        """Why a reasoning-gym prompt cannot be scored (its family is unknown here), or None."""
        if "reasoning_gym" not in prompt.metadata:
            return None
        try:
            self._dataset(prompt)
        except DataError as exc:
            return str(exc)
        return None

    def score(self, prompt: Prompt, completion: str) -> float | None:
        """The family's score of the completion's answer, or None for a prompt of another source."""
        if "reasoning_gym" not in prompt.metadata:
            return None
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(completion) if self.extract == "tags" else final_answer(completion)
        return float(self._dataset(prompt).score_answer(answer, prompt.metadata["entry"]))

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> Tensor:
        """[N] float32 scores, NaN where a prompt is not reasoning-gym's.

        Raises:
            ValueError: the two sequences have different lengths.
            RewardError: a family's scorer raised, or returned something other than a finite number.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"reward {self.name!r}: got {len(prompts)} prompts and {len(completions)} "
                             "completions; pass one prompt per completion")
        scores = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            value = self._score_one(i, prompt, completion)
            if value is not None:
                self._check_value(i, value, prompt, completion)
            scores.append(math.nan if value is None else float(value))
        return check_scores(self.name, torch.tensor(scores, dtype=torch.float32), prompts, completions,
                            allows_none=True)

    def _dataset(self, prompt: Prompt) -> Any:
        """The family's dataset under the prompt's config (its ``score_answer``), built once per config."""
        source = prompt.metadata["reasoning_gym"]
        key = json.dumps([source["family"], source["config"]], sort_keys=True, default=repr)
        if key not in self._datasets:
            check_family(source["family"])
            self._datasets[key] = _created(require_reasoning_gym(), source["family"], dict(source["config"]))
        return self._datasets[key]
