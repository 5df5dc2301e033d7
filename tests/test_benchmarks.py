"""The benchmarks run (so they cannot rot between the sessions that read their tables)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_memory_prints_rss_every_100_games_and_the_halves():
    cmd = [sys.executable, "benchmarks/bench_memory.py", "--games", "200", "--concurrency", "16"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = " ".join(res.stdout.split())
    assert "generate RSS: 200 tiny-model games, 16 in flight" in out
    assert "│ 100 │" in res.stdout.replace("  ", " ") or " 100 " in out
    assert "mean RSS, first half" in out and "ratio" in out


def test_roofline_times_the_attention_the_engine_ran_cascade_included(tiny_model):
    """bench_roofline's "matmuls + attention alone" row reads the engine's counters: in a batch
    whose prompts share a long prefix, the decoding steps read it once (the cascade), and the
    row's attention time and the decode-aware least time come out positive."""
    import asyncio

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_roofline

    from selfplay.engines import GenerationRequest, HFEngineConfig
    from selfplay.engines.hf import HFEngine

    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu", dtype="fp32"))
    rules = engine.tokenizer("Rules: Ava Li on BLEU 320, Sofia Patel on GloVe 122. " * 6)
    reqs = [
        GenerationRequest([*rules["input_ids"], 7 + i], max_new_tokens=6, stop_token_ids=())
        for i in range(4)
    ]

    async def go():
        try:
            return await asyncio.gather(*(engine.generate(r) for r in reqs))
        finally:
            await engine.aclose()

    asyncio.run(go())  # first turns that start alike: their common prefix prefilled once
    assert engine.shared_decode_steps > 0 and engine.decode_shared_by_rows.total() > 0
    assert bench_roofline.attention_seconds(engine, torch.float32, repeats=1) > 0
    assert bench_roofline.decode_aware_seconds(engine, 100.0, 20.0) > 0
