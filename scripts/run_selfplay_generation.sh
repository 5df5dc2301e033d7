#!/usr/bin/env bash
# Compatible with the original generation script: MODEL_NAME, NUM_GAMES, TEMPERATURE,
# MAX_LENGTH (max actions per game) and EXP_NAME (games go to data/$EXP_NAME/games.jsonl).
# Extra arguments go to `selfplay generate`. Re-running resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
export EXP_NAME=${EXP_NAME:-selfplay}
exec .venv/bin/selfplay generate --out "data/${EXP_NAME}" "$@"
