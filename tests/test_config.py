"""Config records: every mistake reported at once with its fix; YAML round trips."""

import pytest
from pydantic import ValidationError

from grpo_engine import GRPOConfig, LoRA, MemoryPlan
from grpo_engine.config import ConfigError
from grpo_engine.spec import RunSpec


def test_several_mistakes_are_all_reported_with_their_fixes():
    with pytest.raises(ConfigError) as info:
        GRPOConfig(group_size=1, temperature=0.0, prompts_per_step="four", top_p=1.5, learning_rate=-1)
    errors = {e["loc"][0]: e["msg"] for e in info.value.errors()}
    assert set(errors) == {"group_size", "temperature", "prompts_per_step", "top_p", "learning_rate"}
    assert "group_size=1 makes every advantage 0" in errors["group_size"]
    assert "use group_size >= 2" in errors["group_size"]
    assert "temperature=0.0 must be > 0" in errors["temperature"]
    assert "use top_p=1.0 to turn it off" in errors["top_p"]


def test_unknown_fields_are_errors_with_a_suggestion():
    data = {
        "model": "m", "train_prompts": {"function": "x.y"}, "rewards": [{"class": "a.B"}],
        "config": {"grup_size": 4, "max_steps": 0}, "memory": {"lora": {"rank": 8}, "micro_batch_size": 0},
    }
    with pytest.raises(ConfigError) as info:
        RunSpec.model_validate(data)
    text = str(info.value)
    assert text.startswith("4 problem(s) in RunSpec:")
    assert "config.grup_size: unknown field; did you mean 'group_size'?" in text
    assert "config.max_steps: max_steps=0 must be >= 1" in text
    assert "memory.lora.rank: unknown field" in text
    assert "memory.micro_batch_size: micro_batch_size=0 must be >= 1" in text


def test_python_errors_name_the_field_the_rule_and_trl_names_without_links():
    with pytest.raises(ConfigError) as info:
        GRPOConfig(num_generations=4, max_completion_length=64, beta=0.04, grup_size=3,
                   prompts_per_step="four")
    text = str(info.value)
    assert text.splitlines() == [
        "5 problem(s) in GRPOConfig:",
        "  - prompts_per_step: Input should be a valid integer, unable to parse string as an integer "
        "(got 'four')",
        "  - num_generations: unknown field; TRL's num_generations is group_size here",
        "  - max_completion_length: unknown field; TRL's max_completion_length is max_completion_tokens here",
        "  - beta: unknown field; TRL's beta is the KL coefficient of the loss here: "
        "loss=ClippedSurrogate(kl_coef=0.04)",
        "  - grup_size: unknown field; did you mean 'group_size'?",
    ]
    assert "pydantic" not in text and "http" not in text
    assert isinstance(info.value, ValueError) and len(info.value.errors()) == 5


def test_every_trl_field_given_to_the_native_config_says_where_it_lives_or_why_not():
    """Each of TRL 1.16's 191 GRPOConfig fields that is not also ours: one line naming the field and where it
    lives here (or why it has none and the nearest setting), never a dump of our fields or a look-alike."""
    from grpo_engine.trl.refused import MAPPED, REFUSED

    ours = set(GRPOConfig.model_fields)
    for field in sorted((set(MAPPED) | set(REFUSED)) - ours):
        with pytest.raises(ConfigError) as info:
            GRPOConfig(**{field: object()})
        line = str(info.value).splitlines()[1]
        assert line.startswith(f"  - {field}: unknown field; ") and "known fields" not in line, line
        if field in GRPOConfig.renamed:  # ours, written for the native API
            assert line.endswith(GRPOConfig.renamed[field]), line
        elif field in REFUSED:
            assert f"TRL's {field} has no equivalent here" in line, line
            assert line.endswith(f"nearest: {REFUSED[field][1]}"), line
        else:
            assert f"TRL's {field} is {MAPPED[field]} here" in line, line
    assert "TRL's use_vllm is " in str(pytest.raises(ConfigError, GRPOConfig, use_vllm=True).value)


def test_yaml_round_trip_and_frozen(tmp_path):
    cfg = GRPOConfig(prompts_per_step=3, group_size=5, adam_betas=(0.9, 0.95), max_grad_norm=None)
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    assert GRPOConfig.from_yaml(path) == cfg
    assert cfg.completions_per_step == 15
    with pytest.raises(ValidationError):
        cfg.group_size = 4  # frozen
    plan = MemoryPlan(lora=LoRA(r=8, target_modules=["q_proj", "v_proj"]), optimizer="adamw8bit")
    assert MemoryPlan.from_yaml(plan.to_yaml()) == plan


def test_memory_plan_rejects_bad_values():
    with pytest.raises(ConfigError) as info:
        MemoryPlan(optimizer="sgd", lora=LoRA(r=0, dropout=1.0))
    text = str(info.value)
    assert "r=0 must be >= 1" in text and "dropout=1.0 must be in [0, 1)" in text


def test_component_spec_needs_exactly_one_target():
    from grpo_engine.spec import ComponentSpec, build

    spec = ComponentSpec.model_validate({"class": "grpo_engine.rewards.MathAccuracy", "weight": 0.5})
    assert build(spec).weight == 0.5
    with pytest.raises(ConfigError, match="exactly one of 'class', 'function' or 'reward_function'"):
        ComponentSpec.model_validate({"weight": 1.0})
    with pytest.raises(ValueError, match="cannot import 'grpo_engine.rewards.Nope'"):
        build(ComponentSpec.model_validate({"class": "grpo_engine.rewards.Nope"}))
