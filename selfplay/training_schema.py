"""The training-row contract: the pyarrow schema of one row per (game, trained seat).

``selfplay convert`` writes it, ``selfplay train`` reads it. It knows nothing of any game, so the
train package can read its input without importing one (``selfplay.records`` re-exports it).
"""

from __future__ import annotations

import pyarrow as pa

TRAINING_SCHEMA_VERSION = 1  # unchanged since the first release


TRAINING_SCHEMA = pa.schema(
    [
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("group_key", pa.string(), nullable=False),
        pa.field("game_id", pa.string(), nullable=False),
        pa.field("scenario_id", pa.string(), nullable=False),
        pa.field("seat", pa.int8(), nullable=False),
        pa.field("round", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        # a guide's row (a scripted player's turns recorded as the model's, --guide): trained
        # off-policy with LUFFY's policy shaping; absent in files written before it (all False)
        pa.field("off_policy", pa.bool_()),
        # the temperature the row's own tokens were sampled at (null: not sampled by a model, or
        # written before the column): rollout_logprobs are log-softmax(logits / temperature)
        pa.field("temperature", pa.float32()),
        # one state id per own turn (a run of mask-1 tokens), for --credit turn: a hash of the seat
        # and the exact tokens before the turn (null: episode credit, or written before the column)
        pa.field("turn_states", pa.list_(pa.int64())),
        pa.field("tokenizer_fingerprint", pa.string()),
        pa.field(
            "messages",
            pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
        ),
        # verl-style columns, so the file also reads as an ordinary verl dataset
        pa.field("data_source", pa.string()),
        pa.field("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        pa.field(
            "reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.float32())])
        ),
        pa.field(
            "extra_info",
            pa.struct(
                [
                    ("index", pa.int64()),
                    ("game_id", pa.string()),
                    ("seat", pa.int8()),
                ]
            ),
        ),
    ],
    metadata={b"selfplay_schema_version": str(TRAINING_SCHEMA_VERSION).encode()},
)
