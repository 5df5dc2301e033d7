#!/usr/bin/env bash
# Compatible with the original training script: converts data/$EXP_NAME/games.jsonl into rows and
# trains MODEL_NAME on them with GRPO (verl) into checkpoints/$EXP_NAME. TRAIN_BATCH_SIZE and
# MICRO_BATCH_SIZE set the batch sizes. Extra arguments go to `selfplay train`.
set -euo pipefail
cd "$(dirname "$0")/.."
EXP_NAME=${EXP_NAME:-selfplay}
MODEL=${MODEL_NAME:-$(.venv/bin/python -c 'from selfplay.models import resolve_model; print(resolve_model(None))')}
.venv/bin/selfplay convert --games "data/${EXP_NAME}/games.jsonl" --out "data/${EXP_NAME}"
exec .venv/bin/selfplay train --data "data/${EXP_NAME}/train.parquet" --model "${MODEL}" \
  --out "checkpoints/${EXP_NAME}" "$@"
