"""Benchmark of `selfplay generate`: runner overhead, hf batching speed-up, memory vs games.

  (a) synthetic engine (every batch answered after a fixed latency), 256 games x 30 actions:
      wall time / ideal, ideal = 30 actions x latency (all games in lockstep). Target <= 1.15.
  (b) hf engine, tiny random model, CPU: games/s with --concurrency 32 vs 1. Target ratio >= 4.
  (c) peak RSS of a generate process (synthetic engine, --concurrency 32) with N and 10 N games:
      it should stay flat (finished games go to disk, never stay in memory).
  (d) hf engine (every core) vs a launched vLLM server (scripts/setup_vllm.sh's venv) on 1 core
      and on every core, SmolLM2-135M (or --model, e.g. a warm-started checkpoint), the same
      generate command (--games, --game, --table-size, --games-per-scenario, --partner,
      --max-actions; T 1, seed 11): games/s and tokens/s (server start apart, printed beside), and
      the in-place weight reload of one checkpoint (an untied copy: vLLM keeps a tied head stale).
  (e) hf engine, SmolLM2-135M (or --model, e.g. a warm-started checkpoint): the same 64 games
      with 1 torch thread and with every core (the default), one process each.
  (f) iterate's held-out evaluation (16 greedy games) and a round's generate (16 games) with the
      same model (--model): each in a child of its own, one after the other in one shared child
      (one start, one model load), and together in one child on one engine, their requests in
      shared batches (iterate's default, --eval-beside-generate); apart, shared, beside, shared,
      beside.
  (g) the linear layers' layout in a decoding step (SmolLM2-135M or --model, fp32, CPU):
      ``F.linear`` (x @ W^T) against the engine's weight-major product (W @ x^T), whole decoding
      steps of --rows rows over --kv positions, the two layouts alternating step by step in one
      process (a shared VM's speed drifts between processes), median step time of each.

Run: .venv/bin/python benchmarks/bench_generate.py [--part a,b,c,d,e,f] [--latency 0.25,0.5,1.0]
     [--model M --partner P --table-size N --max-actions A --games G] (d, e; f takes --model)
     [--game NAME --games-per-scenario K] (d) [--rows 64 --kv 460 --steps 24] (g)
Everything is offline: the tiny model is built into a temporary directory; (d) is not in the
default parts (it builds the vLLM venv when missing and takes ~10 minutes on 2 cores), nor is
(e) (SmolLM2 on CPU, 1-3 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from selfplay.engines.synthetic import SyntheticEngine
from selfplay.game.matching.prompts import tokenizer_corpus
from selfplay.generate.config import GenerateConfig
from selfplay.generate.runner import generate_games
from selfplay.models import build_tiny_model
from selfplay.players.llm import load_chat_format
from selfplay.records import SamplingParams

MESSAGE = "[message] I know Ava Li on BLEU is 320 and Sofia Patel on GloVe is 122. And you?"


def synthetic_run(
    model: Path, out: Path, *, games: int, latency: float, concurrency=None, mode="serial"
):
    """Play ``games`` games of 30 message actions on the synthetic engine; (seconds, result)."""
    chat = load_chat_format(str(model))
    reply = [*chat.encode(MESSAGE), chat.stop_token_ids[0]]
    cfg = GenerateConfig(
        out=out,
        num_games=games,
        model=str(model),
        concurrency=concurrency,
        max_actions=30,
        sampling=SamplingParams(max_new_tokens=64),
    )

    async def go():
        engine = SyntheticEngine(reply, latency_s=latency, mode=mode)
        try:
            start = time.perf_counter()
            result = await generate_games(cfg, engine, chat)
            return time.perf_counter() - start, result, engine.batches
        finally:
            await engine.aclose()

    return asyncio.run(go())


def part_a(model: Path, tmp: Path, latencies: list[float]) -> list[tuple]:
    rows = []
    seconds, _, _ = synthetic_run(model, tmp / "a-0", games=256, latency=0.0)
    rows.append(
        (
            "(a0) runner CPU, no engine latency",
            "256 games x 30 actions",
            f"{seconds:.2f} s = {seconds / (256 * 30) * 1e6:.0f} us per action",
            "",
            "",
        )
    )
    for mode in ("serial", "server"):
        for lat in latencies:
            seconds, result, batches = synthetic_run(
                model, tmp / f"a-{mode}-{lat}", games=256, latency=lat, mode=mode
            )
            ideal = 30 * lat
            assert result.stats.played == 256 and result.summary.mean_actions == 30
            what = f"{batches} batches" if mode == "serial" else "continuous batching"
            rows.append(
                (
                    f"(a) synthetic {mode} engine, 256 games x 30 actions",
                    f"latency {lat:.2f} s",
                    f"wall {seconds:.2f} s, ideal {ideal:.2f} s, {what}",
                    f"{seconds / ideal:.3f}",
                    "<= 1.15",
                )
            )
    return rows


def part_b(model: Path, tmp: Path, games: int = 64) -> list[tuple]:
    """Two settings: decode-bound (3x3 table, 128 new tokens) and prefill-bound (8x8, 32).

    Prefill is compute-bound on CPU, so batching helps decoding far more than prefilling. The hf
    engine's prefix cache prefills only each turn's new tokens, and a batch prefills identical
    prompts once (at concurrency 32 the 4 games of a scenario start together), so what stays
    unbatched is mostly the first prompt of each scenario's games.
    """
    from selfplay.engines import HFEngineConfig
    from selfplay.generate.runner import run_generate

    rows = []
    for n, max_new in ((3, 128), (8, 32)):
        rates = {}
        for conc in (1, 32):
            cfg = GenerateConfig(
                out=tmp / f"b-{n}-{conc}",
                num_games=games,
                model=str(model),
                concurrency=conc,
                table_size=n,
                sampling=SamplingParams(max_new_tokens=max_new),
            )
            result = run_generate(cfg, HFEngineConfig(model=str(model), device="cpu"))
            st = result.stats
            rates[conc] = (st.games_per_s, st.tokens_per_s, st.seconds)
        ratio = rates[32][0] / rates[1][0]
        detail = ", ".join(
            f"c={c}: {g:.2f} games/s {t:.0f} tok/s ({s:.1f} s)" for c, (g, t, s) in rates.items()
        )
        rows.append(
            (
                f"(b) hf engine, tiny model, CPU, {games} games",
                f"concurrency 32 vs 1; {n}x{n} table, {max_new} new tokens",
                detail,
                f"{ratio:.2f}x",
                ">= 4",
            )
        )
    return rows


def part_c(model: Path, tmp: Path, base: int = 64) -> list[tuple]:
    peaks = {}
    for games in (base, 10 * base):
        out = tmp / f"c-{games}"
        cmd = [sys.executable, __file__, "--child", str(model), str(out), str(games)]
        peaks[games] = json.loads(subprocess.check_output(cmd, text=True).strip().splitlines()[-1])
    (n1, p1), (n2, p2) = peaks.items()
    return [
        (
            "(c) peak RSS, synthetic engine, concurrency 32",
            f"{n1} vs {n2} games",
            f"{p1['rss_mib']:.0f} MiB vs {p2['rss_mib']:.0f} MiB; growth during the run "
            f"{p1['growth_mib']:.0f} vs {p2['growth_mib']:.0f} MiB "
            f"({p1['seconds']:.1f} s, {p2['seconds']:.1f} s)",
            f"{p2['rss_mib'] / p1['rss_mib']:.3f}",
            "~1.0 (flat)",
        )
    ]


def part_d(tmp: Path, args) -> list[tuple]:
    """The same games through the hf engine (every core) and through a launched vLLM server on 1
    core and on every core (the server's threads bound by VLLM_CPU_OMP_THREADS_BIND; the game
    loop shares them), then the in-place weight reload of one checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from selfplay.engines import HFEngineConfig, VLLMEngineConfig, open_engine
    from selfplay.generate.runner import run_generate
    from selfplay.hardware import resolve_dtype, usable_cores
    from selfplay.models import resolve_model

    root = Path(__file__).resolve().parents[1]
    setup = subprocess.run(["bash", str(root / "scripts/setup_vllm.sh")], capture_output=True)
    python = str(root / setup.stdout.decode().strip().splitlines()[-1])
    model = resolve_model(args.model)
    dtype = resolve_dtype("auto", "cpu")
    setting = (
        f"{args.games} games of {args.game} {args.table_size}x{args.table_size}, "
        f"{args.games_per_scenario} a scenario, partner {args.partner or 'self'}, "
        f"{args.max_actions} actions, 64 new tokens, T 1, {dtype}"
    )

    def config(out: str) -> GenerateConfig:
        return GenerateConfig(
            out=tmp / out, num_games=args.games, model=model, game=args.game,
            table_size=args.table_size, games_per_scenario=args.games_per_scenario,
            partner=args.partner, max_actions=args.max_actions, seed=11,
            sampling=SamplingParams(max_new_tokens=64, temperature=1.0),
        )  # fmt: skip

    runs = [("hf (in-process, every core)", run_generate(
        config("d-hf"), HFEngineConfig(model=model, device="cpu", dtype=dtype)
    ))]  # fmt: skip
    # an untied copy: the head is its own tensor, so an in-place reload is exact
    untied = tmp / "untied"
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    m.config.tie_word_embeddings = False
    m.lm_head.weight = torch.nn.Parameter(m.get_input_embeddings().weight.detach().clone())
    m.save_pretrained(untied)
    for f in Path(model).iterdir():  # tokenizer and chat template: all but weights and config
        if f.is_file() and not (f.suffix == ".safetensors" or f.name == "config.json"):
            (untied / f.name).write_bytes(f.read_bytes())
    reload_s = None
    for threads in sorted({1, usable_cores()}):
        server = open_engine(
            VLLMEngineConfig(model=str(untied), python=python, dtype=dtype, port=8077,
                             cpu_threads=threads, log_path=str(tmp / f"vllm-{threads}.log"))
        )  # fmt: skip

        async def up(server=server) -> tuple[float, float]:
            t0 = time.perf_counter()
            await server.start()
            started = time.perf_counter() - t0
            t0 = time.perf_counter()
            await server.load_weights(str(untied))
            return started, time.perf_counter() - t0

        loop = asyncio.new_event_loop()
        try:
            started, reload_s = loop.run_until_complete(up())
            attached = VLLMEngineConfig(model=str(untied), url=server.url)
            result = run_generate(config(f"d-vllm-{threads}"), attached)
        finally:
            loop.run_until_complete(server.aclose())
            loop.close()
        runs.append((f"vLLM server, {threads} core(s) (start {started:.0f} s)", result))
    rows = []
    hf = runs[0][1].stats
    for name, r in runs:
        st = r.stats
        rows.append((
            f"(d) {name}", setting,
            f"{st.games_per_s:.3f} games/s, {st.tokens_per_s:.0f} generated tok/s "
            f"({st.seconds:.0f} s)",
            f"{st.games_per_s / hf.games_per_s:.2f}x hf", "",
        ))  # fmt: skip
    rows.append((
        "(d) vLLM weight reload", "reload_weights of an untied copy, in place",
        f"{reload_s:.2f} s", "", "",
    ))  # fmt: skip
    return rows


def part_e(tmp: Path, args) -> list[tuple]:
    """hf engine threads: 1 against every core, the same games, each in a fresh process."""
    from selfplay.hardware import resolve_dtype, usable_cores
    from selfplay.models import resolve_model

    model = resolve_model(args.model)
    setting = (
        f"{args.games} games, {args.table_size}x{args.table_size}, partner "
        f"{args.partner or 'self'}, max {args.max_actions} actions, T 1, "
        f"{resolve_dtype('auto', 'cpu')}"
    )
    rows, base = [], None
    for threads in (1, usable_cores()):
        cmd = [
            sys.executable,
            __file__,
            "--threads-child",
            str(threads),
            model,
            str(tmp / f"e{threads}"),
        ]
        cmd += ["--games", str(args.games), "--table-size", str(args.table_size)]
        cmd += ["--max-actions", str(args.max_actions)]
        cmd += ["--partner", args.partner] if args.partner else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = base or r["seconds"]
        rows.append((
            f"(e) hf engine, {threads} torch thread(s), {Path(model).name}",
            setting,
            f"{r['seconds']:.1f} s: {r['prefilled']} prefilled + {r['generated']} generated "
            f"tokens, {(r['prefilled'] + r['generated']) / r['seconds']:.0f} tok/s",
            f"{base / r['seconds']:.2f}x 1 thread",
            "",
        ))  # fmt: skip
    return rows


def part_f(tmp: Path, args) -> list[tuple]:
    """A held-out evaluation and the next generate: a child each, one after the other in one
    shared child, or together in one child on one engine (iterate's default)."""
    from selfplay.iterate.child import StageChild, default_generate, isolated
    from selfplay.iterate.config import IterateConfig
    from selfplay.iterate.heldout import _heldout_eval
    from selfplay.iterate.stages import beside_possible, generate_beside_heldout, generate_stage
    from selfplay.models import resolve_model

    model = resolve_model(args.model)
    rows, times = [], {}
    labels = {"apart": "a child each", "shared": "one child, one after the other",
              "beside": "one child, together"}  # fmt: skip
    for i, mode in enumerate(("apart", "shared", "beside", "shared", "beside")):
        cfg = IterateConfig(
            name=f"f{i}", iterations=1, model=model, engine={"kind": "hf", "model": model},
            data_root=tmp / "data", checkpoint_root=tmp / "ckpt", table_size=3,
            games_per_iter=16, games_per_scenario=4, eval_scenarios=16, max_actions=10,
            sampling=SamplingParams(max_new_tokens=64, temperature=1.0),
        )  # fmt: skip
        start = time.perf_counter()
        if mode == "beside":
            assert beside_possible(cfg, default_generate)
            (held, _), _ = generate_beside_heldout(
                cfg, 0, model, tmp / f"eval{i}", False, StageChild()
            )
            evaluated = None
        else:
            child = StageChild() if mode == "shared" else None
            job = (_heldout_eval, cfg, model, tmp / f"eval{i}", False)
            (held, _), _ = child.run(*job) if child else isolated(*job)
            evaluated = time.perf_counter()
            generate_stage(cfg, 0, model, {}, child=child)
        end = time.perf_counter()
        times.setdefault(mode, []).append(end - start)
        split = (
            f" (eval {evaluated - start:.1f} s, generate {end - evaluated:.1f} s)"
            if evaluated
            else ""
        )
        rows.append((
            f"(f) held-out eval + generate, {labels[mode]}",
            f"{Path(model).name}, 16 + 16 games, 3x3",
            f"{end - start:.1f} s{split}, held-out reward {held.reward_mean:.3f}",
            "",
            "",
        ))  # fmt: skip
    shared = min(times["shared"])
    for i in (2, 4):
        beside = times["beside"][i // 2 - 1]
        rows[i] = (*rows[i][:3], f"{beside - shared:+.1f} s against the faster shared run", "")
    return rows


def play_hf(cfg: GenerateConfig, engine_config):
    """Play ``cfg``'s games on an hf engine opened here: (run stats, the engine, for its
    prefilled / generated token counts)."""
    from selfplay.engines import open_engine
    from selfplay.generate.runner import generate_games

    engine = open_engine(engine_config)

    async def go():
        try:
            await engine.start()
            return await generate_games(cfg, engine, load_chat_format(cfg.model))
        finally:
            await engine.aclose()

    return asyncio.run(go()).stats, engine


def part_g(args) -> list[tuple]:
    """Decoding steps with F.linear against the weight-major product, alternating."""
    import statistics

    import torch
    from transformers import Cache

    from selfplay.engines import HFEngineConfig, hf_cpu
    from selfplay.engines.hf import HFEngine, PreallocatedLayer, plain_cache_layers
    from selfplay.models import resolve_model

    model = resolve_model(args.model)
    engine = HFEngine(HFEngineConfig(model=model, device="cpu", dtype="fp32"))
    rows, cpu, width = args.rows, engine.model.config, args.kv
    default = hf_cpu.WEIGHT_MAJOR_MAX_ROWS
    cache = Cache(layers=[PreallocatedLayer(width + args.steps + 1) for _ in range(
        plain_cache_layers(engine.model))])  # fmt: skip
    attn = torch.ones(rows, width, dtype=torch.long)
    ids = torch.randint(cpu.vocab_size, (rows, width), generator=torch.Generator().manual_seed(0))
    steps: dict[str, list[float]] = {"F.linear": [], "weight-major": []}
    with torch.inference_mode():
        engine.model(input_ids=ids, attention_mask=attn, past_key_values=cache, use_cache=True,
                     logits_to_keep=1)  # fmt: skip
        pos = torch.full((rows,), width - 1)
        for i in range(args.steps + 2):
            layout = ("F.linear", "weight-major")[i % 2]
            hf_cpu.WEIGHT_MAJOR_MAX_ROWS = 0 if layout == "F.linear" else default
            attn = torch.cat([attn, attn.new_ones((rows, 1))], dim=1)
            pos = pos + 1
            start = time.perf_counter()
            engine.model(input_ids=ids[:, -1:], attention_mask=attn, position_ids=pos[:, None],
                         past_key_values=cache, use_cache=True)  # fmt: skip
            if i >= 2:
                steps[layout].append(time.perf_counter() - start)
    hf_cpu.WEIGHT_MAJOR_MAX_ROWS = default
    plain, major = (1000 * statistics.median(steps[k]) for k in ("F.linear", "weight-major"))
    return [(
        "(g) decoding step, the layouts alternating", f"{Path(model).name}, {rows} rows over "
        f"{width}-{width + args.steps} KV positions, {torch.get_num_threads()} threads",
        f"F.linear {plain:.0f} ms, weight-major {major:.0f} ms (median of {args.steps // 2} each)",
        f"{plain / major:.2f}x", "",
    )]  # fmt: skip


def threads_child(threads: int, model: str, out: str, args) -> None:
    from selfplay.engines import HFEngineConfig

    cfg = GenerateConfig(
        out=Path(out), num_games=args.games, model=model, table_size=args.table_size,
        games_per_scenario=8, partner=args.partner, max_actions=args.max_actions,
        sampling=SamplingParams(max_new_tokens=64, temperature=1.0),
    )  # fmt: skip
    st, engine = play_hf(cfg, HFEngineConfig(model=model, device="cpu", cpu_threads=threads))
    assert st.played == args.games
    print(json.dumps({
        "seconds": st.seconds, "prefilled": engine.prefilled_tokens,
        "generated": engine.generated_tokens,
    }))  # fmt: skip


def child(model: str, out: str, games: int) -> None:
    load_chat_format(model)  # imports and tokenizer first: the baseline is everything but games
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    seconds, result, _ = synthetic_run(
        Path(model), Path(out), games=games, latency=0.005, concurrency=32
    )
    assert result.stats.played == games
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rss_mib": rss, "growth_mib": rss - base, "seconds": seconds}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", default="a,b,c")
    p.add_argument(
        "--latency", default="0.25,0.5,1.0", help="(a): seconds per batch, comma-separated"
    )
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--threads-child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="(d, e): model (default SmolLM2-135M-Instruct)")
    p.add_argument("--partner", default=None, help="(d, e): partner (default self-play)")
    p.add_argument("--table-size", type=int, default=3, help="(d, e)")
    p.add_argument("--max-actions", type=int, default=10, help="(d, e)")
    p.add_argument("--games", type=int, default=64, help="(d, e)")
    p.add_argument("--game", default="matching", help="(d)")
    p.add_argument("--games-per-scenario", type=int, default=4, help="(d)")
    p.add_argument("--rows", type=int, default=64, help="(g): rows of a decoding step")
    p.add_argument("--kv", type=int, default=460, help="(g): KV positions of each row")
    p.add_argument("--steps", type=int, default=24, help="(g): decoding steps timed")
    args = p.parse_args()
    if args.threads_child:
        threads, model, out = args.threads_child
        threads_child(int(threads), model, out, args)
        return
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = build_tiny_model(tmp / "tiny", corpus=tokenizer_corpus())
        rows = []
        parts = set(args.part.split(","))
        if "a" in parts:
            rows += part_a(model, tmp, [float(x) for x in args.latency.split(",")])
        if "b" in parts:
            rows += part_b(model, tmp)
        if "c" in parts:
            rows += part_c(model, tmp)
        if "d" in parts:
            rows += part_d(tmp, args)
        if "e" in parts:
            rows += part_e(tmp, args)
        if "f" in parts:
            rows += part_f(tmp, args)
        if "g" in parts:
            rows += part_g(args)
    table = Table(title="selfplay generate benchmark")
    for col in ("benchmark", "setting", "measured", "result", "target"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    main()
