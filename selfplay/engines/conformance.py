"""The contract every engine keeps, checked through the ``Engine`` protocol alone.

``check_engine(make, prompt_ids)`` opens fresh engines with ``make()`` (each one started, used,
closed) and checks the properties below; a broken one raises ``EngineConformanceError`` naming
the property and what was seen (like ``game.conformance.check_game`` for games). A new engine
(vLLM, a remote API of token ids) runs it in its tests before anything plays a game on it.

- ``identity``: ``name`` is a non-empty string, ``max_context`` an int or None;
- ``shape``: at most ``max_new_tokens`` ids, one finite log-prob <= 0 per id, a finish reason of
  stop/length/abort, ``length`` exactly when the limit was reached without a stop token;
- ``stop-kept``: a stop token that ends a completion is its last id (players record it);
- ``greedy-reproduces``: temperature 0 gives the same ids twice;
- ``seed-reproduces``: one seed gives the same sample twice, and (``sampling``) another seed a
  different one, so a GRPO group of games does not collapse into copies;
- ``concurrent``: requests sent at once get what they get one by one (greedy ids; log-probs within
  ``tolerance``), so batching never changes a game;
- ``too-long``: with a known ``max_context``, a prompt that leaves no room is an
  ``EngineRequestError`` (only that game fails), not a crash;
- ``close-idempotent``: ``aclose`` twice is fine;
- ``reference`` (when given another engine on the same weights): the same ids for greedy and
  seeded requests (greedy only when ``same_sampler`` is false: a server with its own random
  numbers), log-probs within ``tolerance`` (a server against the hf engine).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

from selfplay.engines import Engine, EngineRequestError, Generation, GenerationRequest


class EngineConformanceError(AssertionError):
    """An engine broke its contract; the message names the property and what was seen."""

    def __init__(self, prop: str, detail: str) -> None:
        super().__init__(f"{prop}: {detail}")
        self.prop = prop


def _fail(prop: str, detail: str) -> EngineConformanceError:
    return EngineConformanceError(prop, detail)


async def _run(
    make: Callable[[], Engine], requests: Sequence[GenerationRequest], *, together: bool
) -> list[Generation]:
    engine = make()
    await engine.start()
    try:
        if together:
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        return [await engine.generate(r) for r in requests]
    finally:
        await engine.aclose()


def _check_shape(gen: Generation, req: GenerationRequest) -> None:
    n = len(gen.token_ids)
    if n > req.max_new_tokens:
        raise _fail("shape", f"{n} ids for max_new_tokens={req.max_new_tokens}")
    if len(gen.logprobs) != n:
        raise _fail("shape", f"{len(gen.logprobs)} log-probs for {n} ids")
    bad = [lp for lp in gen.logprobs if not (math.isfinite(lp) and lp <= 1e-6)]
    if bad:
        raise _fail("shape", f"log-probs must be finite and <= 0, got {bad[:3]}")
    if gen.finish_reason not in ("stop", "length", "abort"):
        raise _fail("shape", f"finish reason {gen.finish_reason!r}")
    stopped = n > 0 and gen.token_ids[-1] in req.stop_token_ids
    if gen.finish_reason == "length" and (n != req.max_new_tokens or stopped):
        raise _fail("shape", f"'length' after {n} of {req.max_new_tokens} ids (stop: {stopped})")
    if gen.finish_reason == "stop" and not stopped:
        raise _fail("stop-kept", f"finished 'stop' but the last id {gen.token_ids[-1:]} is no stop")


def _close(a: Generation, b: Generation, tolerance: float) -> bool:
    return a.token_ids == b.token_ids and all(
        abs(x - y) <= tolerance for x, y in zip(a.logprobs, b.logprobs)
    )


async def check_engine_async(
    make: Callable[[], Engine],
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 12,
    sampling: bool = True,
    tolerance: float = 1e-4,
    reference: Callable[[], Engine] | None = None,
    same_sampler: bool = True,
) -> list[str]:
    """Check the engines ``make()`` opens; return the properties checked (see the module)."""
    ids = list(prompt_ids)
    checked = []
    engine = make()
    if not isinstance(engine.name, str) or not engine.name:
        raise _fail("identity", f"name {engine.name!r}")
    await engine.start()
    try:
        if engine.max_context is not None and not isinstance(engine.max_context, int):
            raise _fail("identity", f"max_context {engine.max_context!r}")
        max_context = engine.max_context
    finally:
        await engine.aclose()
    try:
        await engine.aclose()
    except Exception as e:  # a second close must be a no-op
        raise _fail("close-idempotent", f"the second aclose raised {type(e).__name__}: {e}") from e
    checked += ["identity", "close-idempotent"]

    greedy = GenerationRequest(ids, max_new_tokens=max_new_tokens, temperature=0.0)
    seeded = [
        GenerationRequest(ids, max_new_tokens=max_new_tokens, temperature=1.0, seed=s)
        for s in (1, 1, 2)
    ]
    g1, g2, s1, s1b, s2 = await _run(make, [greedy, greedy, *seeded], together=False)
    for gen, req in zip((g1, g2, s1, s1b, s2), (greedy, greedy, *seeded)):
        _check_shape(gen, req)
    checked.append("shape")
    if g1.token_ids != g2.token_ids:
        raise _fail("greedy-reproduces", f"{g1.token_ids} then {g2.token_ids}")
    checked.append("greedy-reproduces")
    if s1.token_ids != s1b.token_ids:
        raise _fail("seed-reproduces", f"seed 1 gave {s1.token_ids} then {s1b.token_ids}")
    if sampling and s1.token_ids == s2.token_ids:
        raise _fail("seed-reproduces", f"seeds 1 and 2 gave the same sample {s1.token_ids}")
    checked.append("seed-reproduces")

    if g1.token_ids:
        stop = GenerationRequest(
            ids, max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(g1.token_ids[0],)
        )
        (first,) = await _run(make, [stop], together=False)
        _check_shape(first, stop)
        if first.token_ids != g1.token_ids[:1] or first.finish_reason != "stop":
            raise _fail(
                "stop-kept",
                f"stopping at {g1.token_ids[0]} gave {first.token_ids} ({first.finish_reason})",
            )
        checked.append("stop-kept")

    variants = [
        GenerationRequest(ids[: max(1, len(ids) - k)], max_new_tokens=max_new_tokens, temperature=0)
        for k in range(4)
    ]
    alone = await _run(make, variants, together=False)
    together = await _run(make, variants, together=True)
    for i, (a, t) in enumerate(zip(alone, together)):
        if not _close(a, t, tolerance):
            raise _fail("concurrent", f"request {i}: alone {a.token_ids}, together {t.token_ids}")
    checked.append("concurrent")

    if max_context is not None:
        too_long = GenerationRequest((ids * (max_context // max(1, len(ids)) + 1))[:max_context])
        try:
            await _run(make, [too_long], together=False)
        except EngineRequestError:
            checked.append("too-long")
        else:
            raise _fail("too-long", f"a prompt of {max_context} tokens was not refused")

    if reference is not None:
        # another sampler (vLLM's own random numbers) draws other samples from the same seed:
        # then only the greedy completion is compared
        pairs = [("greedy", g1, greedy), ("seed 1", s1, seeded[0]), ("seed 2", s2, seeded[2])]
        pairs = pairs if same_sampler else pairs[:1]
        theirs = await _run(reference, [req for _, _, req in pairs], together=False)
        for (name, a, _), b in zip(pairs, theirs):
            if not _close(a, b, tolerance):
                raise _fail("reference", f"{name}: {a.token_ids} against {b.token_ids}")
        checked.append("reference")
    return checked


def check_engine(make: Callable[[], Engine], prompt_ids: Sequence[int], **kwargs) -> list[str]:
    """``check_engine_async`` from synchronous code (a test, a script)."""
    return asyncio.run(check_engine_async(make, prompt_ids, **kwargs))
