"""Benchmark `selfplay convert`: games/s and peak memory on synthetic 8x8 self-play games.

Writes N synthetic games (both seats trained, about 1,500 tokens per seat, a third of them the
seat's own, float32-like log-probs, K games per scenario) and converts the first n of them for
each n in --sizes, each in a fresh process pinned to one CPU core, so that peak RSS is the
conversion's alone and comparable across sizes: it should stay flat while the file grows.

    .venv/bin/python benchmarks/bench_convert.py                 # 2,500 / 5,000 / 10,000 games
    .venv/bin/python benchmarks/bench_convert.py --sizes 1000 --keep
    .venv/bin/python benchmarks/bench_convert.py --sizes 10000 --compression lz4  # the trade
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import typer

from selfplay.game import generate_scenario
from selfplay.records import GameRecord

VOCAB = 49_152
POOL = 512  # distinct seat token lists the games draw from
WORDS = [
    "ava",
    "li",
    "bleu",
    "glove",
    "proposal",
    "reviewer",
    "paper",
    "score",
    "high",
    "low",
    "know",
    "table",
    "what",
    "about",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _seat_tokens(rng: random.Random, seat: int, tokens: int = 1500) -> dict:
    """One seat's token list: a ~350-token prompt, then own turns (mask 1) and partner turns."""
    ids: list[int] = [rng.randrange(VOCAB) for _ in range(350)]
    mask: list[int] = [0] * 350
    messages = [{"role": "user", "content": _text(rng, 300)}]
    own_turn = seat == 0
    while len(ids) < tokens:
        n = rng.randint(30, 70) if own_turn else rng.randint(60, 140)
        ids.extend(rng.randrange(VOCAB) for _ in range(n))
        mask.extend([1 if own_turn else 0] * n)
        messages.append({"role": "assistant" if own_turn else "user", "content": _text(rng, n)})
        own_turn = not own_turn
    if mask[-1] == 0:  # the seat's last turn is its own (its accept or proposal)
        ids.extend(rng.randrange(VOCAB) for _ in range(40))
        mask.extend([1] * 40)
        messages.append({"role": "assistant", "content": _text(rng, 40)})
    lp = np.float32(-rng.expovariate(2.0))  # float32 values, as an engine reports them
    logprobs = [float(np.float32(lp * rng.random())) if m else 0.0 for m in mask]
    return {
        "token_ids": ids,
        "mask": mask,
        "logprobs": logprobs,
        "messages": messages,
        "tokenizer_fingerprint": "0123456789abcdef",
    }


def write_games(path: Path, n_games: int, k: int = 8, seed: int = 0) -> None:
    """Write n_games synthetic records, k consecutive games per scenario (validated once)."""
    rng = random.Random(seed)
    pool = [_seat_tokens(rng, s % 2) for s in range(POOL)]
    seats = [{"kind": "llm", "name": "synthetic", "trained": True, "sampling": None}] * 2
    scenario = None
    with path.open("wb") as f:
        for g in range(n_games):
            if g % k == 0:
                scenario = generate_scenario(g // k, n=8, hard=False).model_dump(mode="json")
                scenario["id"] = f"s{g // k:06d}"
            accepted = rng.random() < 0.6
            reward = rng.choice([0.7, 0.8, 0.9, 1.0]) if accepted else 0.0
            rec = {
                "schema_version": 1,
                "game_id": f"g{g:07d}",
                "scenario_id": scenario["id"],
                "round": 0,
                "seed": g,
                "scenario": scenario,
                "seats": seats,
                "actions": [
                    {"seat": i % 2, "text": _text(rng, 12), "kind": "message", "valid": True}
                    for i in range(20)
                ],
                "tokens": [pool[rng.randrange(0, POOL, 2)], pool[rng.randrange(1, POOL, 2)]],
                "outcome": "accepted" if accepted else "max_actions",
                "score": int(reward * 500),
                "reward": reward,
                "counts": {"actions": 20},
                "timings": {"seconds": 1.0},
            }
            if g == 0:
                GameRecord.model_validate(rec)  # the synthetic records follow the real contract
            f.write(orjson.dumps(rec) + b"\n")


def _peak_rss_kb() -> int:
    """Peak resident memory of this process. VmHWM, not ru_maxrss: Linux carries ru_maxrss over
    from the parent through fork and exec, so a child would report its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def floor(path: Path) -> float:
    """Games/s of orjson.loads alone on the same file: what any Python converter starts from.
    Read with convert's 1 MB buffer: with the default 8 KB one, reading a line costs a third of
    parsing it."""
    t = time.process_time()
    n = 0
    with path.open("rb", buffering=1 << 20) as f:
        for line in f:
            orjson.loads(line)
            n += 1
    return n / (time.process_time() - t)


def _child(games: str, out: str, compression: str) -> None:
    """Run one conversion pinned to one core and print its numbers as JSON."""
    import pyarrow as pa

    from selfplay.convert import ConvertConfig, convert

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    parse_only = floor(Path(games))  # same core, same file, just before: a fair reference
    base = _peak_rss_kb()
    t, cpu = time.perf_counter(), time.process_time()
    s = convert(ConvertConfig(games=Path(games), out=Path(out), compression=compression))
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    peak = _peak_rss_kb()
    print(
        json.dumps(
            {
                "games": s.games_read,
                "rows": s.rows_written,
                "seconds": seconds,
                "cpu_seconds": cpu,
                "parse_only": parse_only,
                "base_rss_kb": base,
                "peak_rss_kb": peak,
                "train_mb": Path(s.train_path).stat().st_size / 1e6,
            }
        )
    )


def main(
    sizes: str = typer.Option("2500,5000,10000", help="Comma-separated numbers of games."),
    k: int = typer.Option(8, help="Games per scenario."),
    keep: bool = typer.Option(False, help="Keep the temporary directory."),
    compression: str = typer.Option("zstd", help="Parquet compression: zstd, lz4, snappy, none."),
    child: list[str] = typer.Option([], hidden=True),
) -> None:
    if child:
        _child(*child)
        return
    counts = sorted(int(x) for x in sizes.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="bench_convert_"))
    full = tmp / "games_full.jsonl"
    t = time.perf_counter()
    write_games(full, counts[-1], k=k)
    print(f"wrote {counts[-1]} synthetic games in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    header = (
        f"{'games':>7} {'input MB':>9} {'rows':>7} {'seconds':>8} {'games/s':>8} "
        f"{'CPU games/s':>12} {'parse-only/s':>13} {'MB/s':>6} {'base RSS MB':>12} "
        f"{'peak RSS MB':>12} {'train MB':>9}"
    )
    print(header)
    print("-" * len(header))
    for n in counts:
        games = full
        if n < counts[-1]:  # the first n lines, streamed (the parent must stay small too)
            games = tmp / f"games_{n}.jsonl"
            with full.open("rb") as src, games.open("wb") as dst:
                for _, line in zip(range(n), src):
                    dst.write(line)
        mb = games.stat().st_size / 1e6
        # games.jsonl is written as games finish, with an fsync per batch, so it is on disk by the
        # time convert reads it; without this, the kernel writes the fresh copy back during the
        # conversion, on the same CPUs (10-20% slower, more noise)
        os.sync()
        res = subprocess.run(
            [
                sys.executable,
                __file__,
                *(f"--child={a}" for a in (games, tmp / f"out_{n}", compression)),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(
            f"{r['games']:>7} {mb:>9.0f} {r['rows']:>7} {r['seconds']:>8.2f} "
            f"{r['games'] / r['seconds']:>8.0f} {r['games'] / r['cpu_seconds']:>12.0f} "
            f"{r['parse_only']:>13.0f} {mb / r['seconds']:>6.0f} "
            f"{r['base_rss_kb'] / 1024:>12.0f} {r['peak_rss_kb'] / 1024:>12.0f} "
            f"{r['train_mb']:>9.0f}"
        )
    print(
        "parse-only/s: orjson.loads alone over the same file on the same core (CPU time), the "
        "floor for any converter that reads JSON lines in Python",
        file=sys.stderr,
    )
    if keep:
        print(f"kept {tmp}", file=sys.stderr)
    else:
        for p in sorted(tmp.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        tmp.rmdir()


if __name__ == "__main__":
    typer.run(main)
