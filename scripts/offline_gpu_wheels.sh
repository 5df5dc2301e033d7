#!/usr/bin/env bash
# Wheels for running selfplay's train stage (verl 0.9.1) on an offline GPU machine whose Python
# already has torch, transformers, accelerate, peft, pyarrow, pandas, rich, typer and httpx (a
# CUDA image), e.g. for `benchmarks/bench_gpu.py`: verl and the imports such an image lacks, for
# CPython 3.12 on x86-64, into DIR (default .whl). Ray is repacked without its cluster binaries,
# dashboard and libraries (80 -> 18 MB): the in-process trainer (one GPU) imports ray but never
# starts it. There, install with
#   pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
# and point SELFPLAY_CACHE at a folder holding smollm2-135m-instruct's tokenizer files.
set -euo pipefail
dir=${1:-.whl}
py=${PYTHON:-python3}
mkdir -p "$dir"
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]/#/--platform=}" -d "$dir" \
  verl==0.9.1 ray==2.60.0 tensordict==0.10.0 torchdata==0.11.0 codetiming==1.4.0 \
  hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  pyvers==0.1.0 pylatexenc==2.11 colorful==0.5.8 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 orjson==3.13.0 sniffio==1.3.1 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 google-api-core==2.44.0 \
  google-auth==2.63.0 googleapis-common-protos==1.76.0 opentelemetry-api==1.45.2 \
  opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2 \
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
# antlr4-python3-runtime 4.9.3 (hydra's pin) is published as a source archive only: build it
"$py" -m pip wheel -q --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
"$py" - "$dir" <<'PY'
import glob, os, sys, zipfile

(src,) = glob.glob(os.path.join(sys.argv[1], "ray-*.whl"))
drop = ("ray/jars/", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet",
        "ray/dashboard/client/build/", "ray/rllib/", "ray/tune/", "ray/serve/", "ray/train/",
        "ray/data/")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if info.filename.startswith(drop):
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"\n".join(x for x in data.split(b"\n") if not x.decode().startswith(drop))
        zout.writestr(info, data)
os.replace(src + ".tmp", src)
PY
du -sh "$dir"
