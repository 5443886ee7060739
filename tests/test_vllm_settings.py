"""VLLMSampler's checks that need no engine: what it refuses, and the install hint where vLLM is missing
(the engine itself is tested in tests/vllm/, in the vLLM venv)."""

import importlib.util

import pytest

from grpo_engine.sampling.vllm import VLLMSampler


def test_it_refuses_a_bad_memory_share_and_unknown_settings(tiny_model, tokenizer):
    with pytest.raises(TypeError, match=r"unknown settings \['enforce_eager'\]; vLLM arguments go in"):
        VLLMSampler(tiny_model, tokenizer, engine_model="x", enforce_eager=True)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must be in \(0, 1\]"):
        VLLMSampler(tiny_model, tokenizer, engine_model="x", gpu_memory_utilization=1.5)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_it_says_how_to_install_it(tiny_model, tokenizer):
    with pytest.raises(ImportError, match="make vllm-venv"):
        VLLMSampler(tiny_model, tokenizer, engine_model="x")
