#!/usr/bin/env bash
# A side venv with a released SGLang for the release check (tests/test_sglang_release.py), default
# .venv-sglang (SELFPLAY_SGLANG_VENV moves it). No GPU is needed: the check parses our launch
# commands and runs SGLang's HTTP front end (request parsing, tokenizer manager, answers) on CPU.
# So sglang is installed without its dependencies (CUDA kernels and builds: GBs, of no use here),
# over the CPU torch, plus only what its server code imports, each at the version sglang's own
# metadata pins where it pins one. Idempotent like setup.sh. Prints the venv's python path last;
# pip's output goes to stderr. Exit 3: a package could not be installed (no registry, no such
# release); any other failure is a real one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${SELFPLAY_SGLANG_VENV:-.venv-sglang}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
SGLANG_VERSION=0.5.23
# What sglang.srt.entrypoints.http_server, the tokenizer manager and the request structs import
# (triton too: sglang imports it at start-up, though it runs nothing with it on CPU).
NEEDED=(
  numpy packaging requests tqdm pillow pydantic fastapi python-multipart uvicorn uvloop orjson
  msgspec pybase64 pyzmq aiohttp setproctitle transformers tokenizers sentencepiece
  compressed-tensors gguf openai partial_json_parser einops xgrammar soundfile apache-tvm-ffi
  jsonschema dill IPython triton
)
STAMP="$VENV/.selfplay-sglang"
WANT="$(sha256sum scripts/setup_sglang_check.sh | cut -d' ' -f1) sglang=$SGLANG_VERSION torch=$TORCH_VERSION"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
install() { $PIP install -q "$@" >&2 || { echo "cannot install: $*" >&2; exit 3; }; }
install --upgrade pip
# CPU torch first, and held there (an unpinned one pulls GBs of CUDA packages).
echo "torch==${TORCH_VERSION}" > "$VENV/constraints.txt"
"$VENV/bin/python" -c "import torch" 2>/dev/null || install "torch==${TORCH_VERSION}"
install --no-deps "sglang==${SGLANG_VERSION}"
mapfile -t REQS < <("$VENV/bin/python" - "${NEEDED[@]}" <<'EOF'
import importlib.metadata as md
import re
import sys

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

pins = {}
for req in md.requires("sglang") or []:
    m = re.match(r"\s*([A-Za-z0-9._-]+)(\[[^\]]*\])?\s*([^;]*)(;.*)?$", req)
    if m and "extra ==" not in (m.group(4) or ""):
        pins[norm(m.group(1))] = m.group(3).strip()
for name in sys.argv[1:]:
    print(name + pins.get(norm(name), ""))
EOF
)
install -c "$VENV/constraints.txt" "${REQS[@]}"
"$VENV/bin/python" tests/sglang_release_check.py --import-only >&2
echo "$WANT" > "$STAMP"
echo "$VENV/bin/python"
