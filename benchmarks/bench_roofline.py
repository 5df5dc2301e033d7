"""Roofline of this CPU for SmolLM2-135M: matmul GFLOP/s at the model's shapes, the tokens/s limit
that follows, and (optionally) the measured tokens/s of the real stages against that limit.

1. Matmul GFLOP/s (torch.matmul, fp32 and/or bf16 tensors, median of --repeats after --warmup) at
   the model's shapes for --tokens rows (512: prefill/training-like): the attention projections
   (576x576 for q and o, 576x192 for k and v), the MLP (576x1536 gate/up, 1536x576 down) and the
   lm head (576x49152). The effective GFLOP/s of a forward pass weights each shape by its FLOPs
   (per layer x 30 layers, lm head once): total FLOPs / sum(FLOPs / rate).
2. The tokens/s limit = effective GFLOP/s / FLOPs per token, with forward FLOPs per token
   = 2 x non-embedding params + 2 x 576 x 49152 (lm head; attention scores are left out) and
   factor 1 for generation, 3 for an SFT step (forward + backward), 4 for a GRPO step (old
   log-prob forward + forward + backward). Decoding one token at a time is memory-bound, so the
   generate limit is an upper bound that a small batch does not reach.
3. --stages (minutes): tokens/s of the real stages on the embedded SmolLM2-135M, as a ratio of the
   limit (targets: generate 0.5, issue 50; SFT and the update 0.6): generate (hf engine, 64
   games as a round of recipes/learn.toml, prompt tokens
   prefilled + generated tokens: KV the engine reuses is not counted, so sparing prefill can
   lower this rate while games/s rise; games/s are in the notes), with a second, decode-aware
   limit beside it (below), SFT
   (benchmarks/bench_sft.py, verl) and the train update (benchmarks/bench_train.py, verl). They
   run in --dtype, or with --dtype both in the dtype `resolve_dtype("auto", "cpu")` picks. The
   matmul rates are measured again after the stages and the limit takes the higher effective
   rate of the two readings: the roofline is the machine's peak, and a shared VM's rate moves by
   a third within minutes (both readings are printed).

The decode-aware generate limit: a decoding step computes one token per row but reads every
weight and each row's KV cache, so its time is at least max(FLOPs / FLOP rate, bytes / memory
bandwidth). The bandwidth is measured here (torch sum over a 1 GiB tensor); the engine counts its
decoding steps, rows and KV positions read; the stage's least time is prefill FLOPs / rate +
max(decode FLOPs / rate, (steps x weight bytes + KV positions x KV bytes) / bandwidth), summed over
the run (a bound no schedule of the same passes beats), and the limit is its tokens / that time.

A third generate row, "its matmuls alone": the same prefill, and each decoding step's linear
layers timed on their own at that step's rows (the engine counts steps by rows; the engine's
linear layout in the run's dtype, or oneDNN's products on packed weights where its lean step
packed them, median of --repeats), summed. A step of 20-60 rows runs its
matmuls far below the FLOP rate of 512 rows while reading the weights slower than the bandwidth
allows, so neither limit above binds there; this row says how much of the stage's time its
matmuls at their own shapes take, and so how much is everything else (attention over the KV
cache, norms, sampling, the engine's bookkeeping). A fourth, "matmuls + attention alone",
adds each decoding step's attention timed on its own (the engine's decoding attention: the cascade
over a batch's shared prefix where its steps used it, else the lean step's ``hf_cpu.grouped_flash``
(SDPA, or ``hf_cpu.grouped_decode_attention`` where ``--decode-attention grouped``, for a model
the lean step does not cover; each row's own columns by the compiled kernel, ``hf_native``,
where the lean step has it), at the step's rows and
the mean widths of steps of that many rows, every layer its own KV): what the stage's kernels
at their own shapes take on this CPU, so its ratio says how much of the stage is the engine's
and the model's glue (norms, rotary, sampling, Python) rather than kernels.

Every reading runs on the engine thread (``selfplay.engines.batching.engine_thread``), where
the engine runs its batches: torch work on a second thread would give the process a second
OpenMP pool, and libgomp's idle threads then sleep between parallel regions (the stage about
1.2x slower).

Run: .venv/bin/python benchmarks/bench_roofline.py [--dtype fp32|bf16|both] [--threads N]
     [--tokens 512] [--repeats 10] [--stages] [--decode-attention cascade|grouped|sdpa]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from selfplay.engines.batching import on_engine_thread
from selfplay.hardware import cpu_flags, cpu_name, resolve_dtype

ROOT = Path(__file__).resolve().parents[1]

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
KV = 192  # 3 kv heads x head dim 64
# (name, k, n, matmuls per forward pass)
SHAPES = [
    ("attn q/o", HIDDEN, HIDDEN, 2 * LAYERS),
    ("attn k/v", HIDDEN, KV, 2 * LAYERS),
    ("mlp gate/up", HIDDEN, INTER, 2 * LAYERS),
    ("mlp down", INTER, HIDDEN, LAYERS),
    ("lm head", HIDDEN, VOCAB, 1),
]
FWD_FLOPS_PER_TOKEN = sum(2 * k * n * count for _, k, n, count in SHAPES)
FACTORS = {"generate": 1, "SFT step": 3, "GRPO step": 4}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# measured / limit targets: generate's from issue 50, the training stages' from the one before
TARGETS = {"generate": 0.5, "train": 0.6}
BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def median_seconds(fn, warmup: int, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops(tokens: int, k: int, n: int, dtype, warmup: int, repeats: int) -> float:
    a, b = torch.randn(tokens, k).to(dtype), torch.randn(k, n).to(dtype)
    return 2 * tokens * k * n / median_seconds(lambda: torch.matmul(a, b), warmup, repeats) / 1e9


def effective_gflops(rates: dict[str, float]) -> float:
    """FLOP-weighted rate of a forward pass: total FLOPs / time spent at each shape's rate."""
    seconds = sum(2 * k * n * count / rates[name] for name, k, n, count in SHAPES)
    return FWD_FLOPS_PER_TOKEN / seconds


def read_gbs(repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s: the median time of summing a 1 GiB fp32 tensor."""
    x = torch.ones(2**28)
    return x.numel() * x.element_size() / median_seconds(x.sum, 1, repeats) / 1e9


def decode_aware_seconds(engine, gflops: float, gbs: float) -> float:
    """The least time the engine's passes take on this machine (module docstring)."""
    from selfplay.engines.hf import kv_bytes_per_token

    model = engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = kv_bytes_per_token(model)
    rate = gflops * 1e9
    prefill = engine.prefilled_tokens * FWD_FLOPS_PER_TOKEN / rate
    compute = engine.decode_rows * FWD_FLOPS_PER_TOKEN / rate
    memory = (engine.decode_steps * weight_bytes + engine.decode_kv_slots * kv_bytes) / (gbs * 1e9)
    return prefill + max(compute, memory)


def linear_seconds(rows: int, dtype, repeats: int, packed: bool = False) -> float:
    """One forward pass's linear layers (SHAPES) at ``rows`` rows, in the layout the CPU engine
    uses (selfplay.engines.hf_cpu.weight_major_linears, or with ``packed`` the lean step's
    oneDNN products on packed weights, hf_step.PACKED_DECODE): the median time of each, times its
    count per pass, summed."""
    from selfplay.engines import hf_step
    from selfplay.engines.hf_cpu import weight_major_linears

    total = 0.0
    for _, k, n, count in SHAPES:
        layer = torch.nn.Linear(k, n, bias=False).to(dtype)
        weight_major_linears(layer)
        x = torch.randn(rows, k).to(dtype)
        product = functools.partial(layer, x)
        if packed:
            product = functools.partial(
                hf_step._packed_product, hf_step._pack(layer.weight), None, x
            )
        with torch.inference_mode():
            total += median_seconds(product, 2, repeats) * count
    return total


def matmuls_alone_seconds(engine, gflops: float, dtype, repeats: int = 5) -> float:
    """Prefill FLOPs / rate plus every decoding step's linear layers timed at its rows (in the
    products the engine's steps ran: packed where its lean step was)."""
    from selfplay.engines import hf_step

    packed = engine._lean is not None and engine._lean.packed and hf_step.PACKED_DECODE
    prefill = engine.prefilled_tokens * FWD_FLOPS_PER_TOKEN / (gflops * 1e9)
    steps = engine.decode_batches
    return prefill + sum(
        n * linear_seconds(rows, dtype, repeats, packed) for rows, n in steps.items()
    )


def attention_seconds(engine, dtype, repeats: int = 3) -> float:
    """Every decoding step's attention timed alone: for each batch size, the engine's decoding
    attention at its steps' mean widths over every layer, each layer its own KV (the cache is
    read from memory, as in a step), times its steps. The attention is the engine's: where its
    steps read a shared prefix once (``hf_cpu.cascade_decode_attention``), that at the mean
    shared and own widths; else, in the lean step, ``hf_cpu.grouped_flash``, and in
    transformers' forward SDPA with GQA (or ``hf_cpu.grouped_decode_attention`` where
    ``hf_cpu.GROUPED_DECODE``), with a padding mask. Where the lean step has the compiled
    attention (``hf_native``), each row's own columns are attended to by it, at runs built
    once a step as the step builds them."""
    from selfplay.engines import hf_cpu, hf_native
    from selfplay.engines.hf import attention_shape

    lean = engine._lean
    lib = lean.native if lean is not None and hf_native.NATIVE_ATTENTION else None

    layers_n, heads, kv_heads, dim = attention_shape(engine.model)
    total = 0.0
    for rows, steps in engine.decode_batches.items():
        shared_sum = engine.decode_shared_by_rows[rows]
        shared = round(shared_sum / steps)
        # positions read: rows x own width per step, plus each cascaded step's shared once
        own = max(1, round((engine.decode_kv_by_rows[rows] - shared_sum) / (rows * steps)))
        width = own + shared
        # the lean step's queries are fp32 whatever the model's dtype (its KV cache is that dtype)
        q = torch.randn(rows, heads, 1, dim).to(torch.float32 if lean is not None else dtype)
        kvs = []
        for _ in range(layers_n):
            k, v = torch.randn(2, rows, kv_heads, width, dim).to(dtype)
            k[:, :, :shared], v[:, :, :shared] = k[:1, :, :shared], v[:1, :, :shared]
            kvs.append((k, v))
        mask = torch.ones(rows, 1, 1, width, dtype=torch.bool)
        # the lean step's additive mask, built once a step as the step builds it
        cut = hf_cpu.additive_mask(mask, dtype)

        runs = hf_native.mask_runs(mask[:, 0, 0, shared:])

        def attend(q, k, v, mask, shared=shared, cut=cut, runs=runs):
            if lib is not None:
                return hf_native.attention(lib, q, k, v, runs, None, shared)
            q = q.to(k.dtype)  # torch's kernels run in the cache's dtype (as the lean step's)
            if shared:
                prefix = hf_cpu.SharedPrefix(shared)
                return hf_cpu.cascade_decode_attention(q, k, v, mask, None, prefix)
            if engine._lean is not None:
                return hf_cpu.grouped_flash(q, k, v, cut, dim**-0.5)
            if hf_cpu.GROUPED_DECODE:
                return hf_cpu.grouped_decode_attention(q, k, v, mask)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True
            )

        def layers(q=q, kvs=kvs, mask=mask, attend=attend):
            for k, v in kvs:
                attend(q, k, v, mask)

        total += steps * median_seconds(layers, 1, repeats)
    return total


def limit_tokens_per_s(gflops: float, factor: int) -> float:
    return gflops * 1e9 / (FWD_FLOPS_PER_TOKEN * factor)


def stage_generate(model: str, dtype: str, tmp: Path):
    """A short real generate stage (64 games, a round of recipes/learn.toml): its stats, engine."""
    from bench_generate import play_hf  # (this folder: sys.path[0] when run as a script)

    from selfplay.engines import HFEngineConfig
    from selfplay.generate.config import GenerateConfig
    from selfplay.seats import SamplingParams

    cfg = GenerateConfig(
        out=tmp / "generate", num_games=64, model=model, table_size=3, games_per_scenario=4,
        max_actions=10, sampling=SamplingParams(max_new_tokens=64, temperature=1.0),
    )  # fmt: skip
    return play_hf(cfg, HFEngineConfig(model=model, device="cpu", dtype=dtype))


def generate_rates(st, engine, dtype: str, gflops: float, gbs: float):
    """tokens/s through the model (prefilled prompt tokens + generated tokens), a note, the
    decode-aware limit of those passes in tokens/s, their matmuls' alone, and their matmuls'
    and attention's alone."""
    tokens = engine.prefilled_tokens + engine.generated_tokens
    least = decode_aware_seconds(engine, gflops, gbs)
    shared = engine.decode_shared_by_rows.total() / max(1, engine.shared_decode_steps)
    note = (
        f"{engine.prefilled_tokens} prefilled + {engine.generated_tokens} generated tokens, "
        f"{st.played} games in {st.seconds:.1f} s ({st.played / st.seconds:.2f} games/s), "
        f"{torch.get_num_threads()} engine threads; {engine.decode_steps} decoding steps of "
        f"{engine.decode_rows / max(1, engine.decode_steps):.1f} rows ({engine.shared_decode_steps}"
        f" reading a mean {shared:.0f} shared KV positions once), least time {least:.1f} s"
    )
    alone = matmuls_alone_seconds(engine, gflops, DTYPES[dtype])
    attention = attention_seconds(engine, DTYPES[dtype])
    rates = tokens / least, tokens / alone, tokens / (alone + attention)
    return tokens / st.seconds, note, *rates


def stage_script(cmd: list[str], pattern: str) -> float | None:
    """Run a benchmark script; the tokens/s its output matches with ``pattern`` (None: failed)."""
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT)
    match = re.search(pattern, out.stdout)
    if out.returncode != 0 or match is None:
        sys.stderr.write(out.stderr[-2000:])
        return None
    return float(match.group(1).replace(",", ""))


def run_stages(dtype: str, before: float, measure, gbs: float) -> Table:
    """The stages, then a second matmul reading (``measure()``): the limit takes the higher of
    the two, the machine's peak (a shared VM's matmul rate moves between minutes: 70-117 GFLOP/s
    within ten minutes on the AVX2-only EPYC)."""
    from selfplay.models import embedded_model_dir

    model = str(embedded_model_dir())
    with tempfile.TemporaryDirectory(prefix="bench_roofline_") as tmp:
        st, engine = stage_generate(model, dtype, Path(tmp))
    sft = stage_script(
        ["benchmarks/bench_sft.py", "--rows", "8", "--only", f"verl-{dtype}"],
        rf"verl-{dtype}: (\d+) tokens/s",
    )
    train = stage_script(
        ["benchmarks/bench_train.py", "--model", model, "--rows", "8", "--micro", "4",
         "--repeats", "1", "--dtype", dtype],
        r"\| verl update \(selfplay\) \| [\d.]+ \| ([\d,]+) \|",
    )  # fmt: skip
    after = measure()
    gflops = max(before, after)
    gen, note, gen_limit, gen_alone, gen_kernels = on_engine_thread(
        generate_rates, st, engine, dtype, gflops, gbs
    )
    table = Table(
        title=f"measured stages, SmolLM2-135M, {dtype}, vs the {dtype} limit at {gflops:.1f} "
        f"GFLOP/s (matmul readings: {before:.1f} before the stages, {after:.1f} after)"
    )
    for col in ("stage", "tokens/s", "limit tokens/s", "measured / limit", "target", "notes"):
        table.add_column(col, justify="left" if col in ("stage", "notes") else "right")
    fwd, fwd_bwd = (limit_tokens_per_s(gflops, FACTORS[s]) for s in ("generate", "SFT step"))
    rows = [
        ("generate (hf engine)", gen, fwd, note),
        ("generate, decode-aware limit", gen, gen_limit, f"read bandwidth {gbs:.1f} GB/s"),
        ("generate, its matmuls alone", gen, gen_alone, "each step's linear layers at its rows"),
        ("generate, matmuls + attention alone", gen, gen_kernels, "and each step's attention"),
        ("SFT step (verl)", sft, fwd_bwd, "bench_sft.py --rows 8"),
        # bench_train times the update only (forward + backward): old log-probs are not timed
        ("train update (verl)", train, fwd_bwd, "bench_train.py --rows 8, fwd+bwd"),
    ]
    for name, measured, limit, note in rows:
        # the target is against the FLOP limit; the other generate rows say where the time goes
        target = "-"
        if name.startswith(("generate (", "SFT", "train")):
            target = f"{TARGETS['generate' if name.startswith('generate') else 'train']}"
        if measured is None:
            table.add_row(name, "failed", f"{limit:,.0f}", "-", target, f"see {note}")
        else:
            ratio = f"{measured / limit:.2f}"
            table.add_row(name, f"{measured:,.0f}", f"{limit:,.0f}", ratio, target, note)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--tokens", type=int, default=512, help="rows of each matmul")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--stages", action="store_true", help="also time the real stages (minutes)")
    ap.add_argument(
        "--decode-attention",
        choices=["cascade", "grouped", "sdpa"],
        default=None,
        help="the engine's decoding attention (cascade: over a batch's shared prefix, SDPA "
        "else; hf_cpu.CASCADE and GROUPED_DECODE; default: the engine's default), to A/B the "
        "stages",
    )
    args = ap.parse_args()
    from selfplay.engines import hf_cpu

    if args.decode_attention:
        hf_cpu.GROUPED_DECODE = args.decode_attention == "grouped"
        hf_cpu.CASCADE = args.decode_attention == "cascade"
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    console = Console()

    flags = cpu_flags()
    console.print(f"CPU: {cpu_name()}")
    console.print("flags: " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in BF16_FLAGS))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    threads = torch.get_num_threads()
    console.print(f"torch threads: {threads} of {os.cpu_count()} cores, load average {load}")
    console.print(f'resolve_dtype("auto", "cpu") -> {resolve_dtype("auto", "cpu")}')
    console.print(f"forward FLOPs per token: {FWD_FLOPS_PER_TOKEN / 1e6:.1f} M")
    attention = "grouped" if hf_cpu.GROUPED_DECODE else "sdpa"
    attention = f"the lean step's grouped flash ({attention} where it does not cover the model)"
    attention = f"cascade over a shared prefix, else {attention}" if hf_cpu.CASCADE else attention
    from selfplay.engines import hf_native

    if hf_native.NATIVE_ATTENTION and on_engine_thread(hf_native.kernel) is not None:
        attention += "; in the lean step, each row's own columns by the compiled kernel (hf_native)"
    console.print(f"the engine's decoding attention: {attention}")

    def measure(dtype: str) -> dict[str, float]:
        """The matmul rates at SHAPES, read on the engine thread (the module docstring)."""
        return on_engine_thread(lambda: {
            name: matmul_gflops(args.tokens, k, n, DTYPES[dtype], args.warmup, args.repeats)
            for name, k, n, _ in SHAPES
        })  # fmt: skip

    rates = {d: measure(d) for d in dtypes}
    effective = {d: effective_gflops(rates[d]) for d in dtypes}

    table = Table(title=f"matmul GFLOP/s, {args.tokens} tokens, {torch.get_num_threads()} threads")
    table.add_column("shape")
    table.add_column("per forward", justify="right")
    table.add_column("share of FLOPs", justify="right")
    for dtype in dtypes:
        table.add_column(f"{dtype} GFLOP/s", justify="right")
    for name, k, n, count in SHAPES:
        share = 2 * k * n * count / FWD_FLOPS_PER_TOKEN
        cells = [f"{rates[d][name]:.1f}" for d in dtypes]
        table.add_row(f"{name} ({k}x{n})", f"{count}", f"{share:.1%}", *cells)
    table.add_row("effective (FLOP-weighted)", "", "100%", *[f"{effective[d]:.1f}" for d in dtypes])
    console.print(table)

    limits = Table(title="tokens/s limit = effective GFLOP/s / (fwd FLOPs/token x factor)")
    limits.add_column("stage")
    limits.add_column("factor", justify="right")
    for dtype in dtypes:
        limits.add_column(f"{dtype} tokens/s", justify="right")
    for stage, factor in FACTORS.items():
        cells = [f"{limit_tokens_per_s(effective[d], factor):,.0f}" for d in dtypes]
        limits.add_row(stage, f"{factor}x forward", *cells)
    console.print(limits)

    gbs = on_engine_thread(read_gbs)
    console.print(f"memory read bandwidth: {gbs:.1f} GB/s (sum over a 1 GiB tensor)")
    if args.stages:
        dtype = resolve_dtype("auto", "cpu") if args.dtype == "both" else args.dtype
        again = lambda: effective_gflops(measure(dtype))  # noqa: E731
        console.print(run_stages(dtype, effective[dtype], again, gbs))
    else:
        console.print("stages not run (--stages); see also bench_sft.py / bench_train.py")


if __name__ == "__main__":
    main()
