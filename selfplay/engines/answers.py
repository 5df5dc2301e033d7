"""What a server engine's answer must be before a game uses it: token ids that are integers in
the model's vocabulary, finite log-probs at most 0, no more tokens than were asked for.

An answer that breaks one of these is not a sampled move: it is a server running another model,
a proxy rewriting numbers, or a bug, and every later answer would break it too. So it stops the
run (``EngineFailure``) with what the server sent and what was expected, instead of failing deep
inside the tokenizer (``out of range integral type conversion``) or in convert (NaN log-probs).
"""

from __future__ import annotations

import math
from pathlib import Path

from selfplay.engines import EngineFailure, Generation, GenerationRequest
from selfplay.engines.servertext import server_text


def vocab_size(model: str) -> int | None:
    """The rows of ``model``'s input embedding, read from its local config.json; None where the
    model is not a local directory (an id only the server resolves): then ids are only checked
    to be non-negative integers."""
    import json

    config = Path(model) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    size = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


def check_answer(
    gen: Generation, request: GenerationRequest, vocab: int | None, where: str
) -> Generation:
    """``gen`` when it is a usable answer to ``request``, else ``EngineFailure`` naming
    ``where`` (the server) and the first problem."""
    n, ask = len(gen.token_ids), request.max_new_tokens
    if n > ask:
        raise EngineFailure(f"{where} sent {n} tokens for a request of at most {ask}")
    if len(gen.logprobs) != n:
        raise EngineFailure(f"{where} sent {len(gen.logprobs)} log-probs for {n} token ids")
    for i, t in enumerate(gen.token_ids):
        if type(t) is not int or t < 0 or (vocab is not None and t >= vocab):
            bound = f"0 to {vocab - 1}" if vocab is not None else "a non-negative integer"
            raise EngineFailure(
                f"{where} sent token id {server_text(repr(t), 40)} at position {i}, not an id "
                f"of the model ({bound}): is the server running another model?"
            )
    for i, p in enumerate(gen.logprobs):
        if not isinstance(p, (int, float)) or not math.isfinite(p) or p > 1e-3:
            raise EngineFailure(
                f"{where} sent log-prob {server_text(repr(p), 40)} at position {i}; a log-prob is "
                "a finite number at most 0"
            )
    return gen
