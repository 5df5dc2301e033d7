#!/usr/bin/env bash
# Compatible with the original iteration script: INITIAL_MODEL (or MODEL_NAME), NUM_ITERATIONS,
# GAMES_PER_ITER, EPOCHS_PER_ITER, TEMPERATURE, MAX_LENGTH, TRAIN_BATCH_SIZE, MICRO_BATCH_SIZE and
# EXP_NAME (the run: data/$EXP_NAME, checkpoints/$EXP_NAME). Re-running resumes the run.
# Extra arguments go to `selfplay iterate`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/selfplay iterate "$@"
