"""A/B of the CPU engine's decoding attention: torch's SDPA (``enable_gqa``) against
``hf_cpu.grouped_decode_attention`` (one product per KV head over its group of query heads) and
``hf_cpu.cascade_decode_attention`` (the batch's shared prefix attended to once for all rows),
alternating call by call in one process so that a shared machine's drift hits all alike.

1. attention alone: every layer's attention of a decoding step at ``--rows`` rows over ``--kv``
   positions, at the model's shapes (layers, query heads, KV heads, head dim), each layer its
   own KV as a view into preallocated room (as ``PreallocatedLayer`` hands it over), the first
   ``--shared`` columns the same in every row (the engine's layout of a batch whose prompts
   start alike) and padding after them; also a plain sum over the same K and V, the bandwidth
   bound;
2. a whole decoding step of the model (the engine's CPU layouts) over a cache of random KV of
   that layout (no prefill: its values do not change a step's work): SDPA, grouped
   (``hf_cpu.GROUPED_DECODE``), the cascade over the shared columns (what the engine does), and
   SDPA with the sibling projections apart (``hf_cpu.FUSED_PROJECTIONS`` off: q, k, v and gate,
   up as separate products), and the engine's lean step (``hf_step.LeanDecode``: no transformers
   glue, the cascade), feature-major (MKL's ``W @ x``) and, where the engine packed them, on
   oneDNN-packed weights in rows (``hf_step.PACKED_DECODE``), switched step by step; and the
   lean step on packed weights with each row's own columns attended to by the compiled kernel
   (``hf_native``; the attention-alone rows time it too) where this machine built it.

    .venv/bin/python benchmarks/bench_decode_attention.py [--model embedded] [--rows 48]
        [--kv 470] [--shared 240] [--repeats 10] [--threads N] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from selfplay.engines import HFEngineConfig, hf_cpu, hf_native, hf_step
from selfplay.engines.hf import HFEngine, PreallocatedLayer, attention_shape
from selfplay.engines.hf_cpu import SHARED_PREFIX, SharedPrefix
from selfplay.models import resolve_model


def alternate(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, called in turn ``repeats`` times after one warm-up."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def padding(rows: int, kv: int, shared: int) -> torch.Tensor:
    """A batch's attention mask ``[rows, kv]``: padding of a different width a row after the
    ``shared`` first columns (left padding where 0)."""
    attn = torch.ones(rows, kv, dtype=torch.long)
    for b in range(rows):
        attn[b, shared : shared + (7 * b) % ((kv - shared) // 4)] = 0
    return attn


def random_kv(rows: int, kv_heads: int, kv: int, dim: int, shared: int, room: int, g) -> list:
    """Keys and values: a view of the first ``kv`` positions of ``room``, the first ``shared``
    the same in every row."""
    out = []
    for _ in range(2):
        x = torch.randn(rows, kv_heads, room, dim, generator=g)
        x[:, :, :shared] = x[:1, :, :shared]
        out.append(x[..., :kv, :])
    return out


def attention_alone(model, rows, kv, shared, dtype, repeats) -> dict[str, float]:
    layers, heads, kv_heads, dim = attention_shape(model)
    g = torch.Generator().manual_seed(0)
    caches = [
        [x.to(dtype) for x in random_kv(rows, kv_heads, kv, dim, shared, kv + 64, g)]
        for _ in range(layers)
    ]
    query = torch.randn(rows, heads, 1, dim, generator=g).to(dtype)
    mask = padding(rows, kv, shared).bool()[:, None, None, :]

    def sdpa():
        for k, v in caches:
            torch.nn.functional.scaled_dot_product_attention(
                query, k, v, attn_mask=mask, enable_gqa=True
            )

    def grouped():
        for k, v in caches:
            hf_cpu.grouped_decode_attention(query, k, v, mask)

    def cascade():
        prefix = SharedPrefix(shared)
        for k, v in caches:
            hf_cpu.cascade_decode_attention(query, k, v, mask, None, prefix)

    def read():
        for k, v in caches:
            k.sum(), v.sum()

    fns = {"SDPA": sdpa, "grouped": grouped, f"cascade ({shared} shared)": cascade}
    lib = hf_native.kernel()
    if lib is not None:  # the lean step's: fp32 queries over the cache in its dtype
        runs = hf_native.mask_runs(mask[:, 0, 0, shared:])
        wide = query.float()

        def native():
            for k, v in caches:
                hf_native.attention(lib, wide, k, v, runs, None, shared)

        fns[f"compiled ({shared} shared read from row 0)"] = native
    with torch.inference_mode():
        return alternate({**fns, "sum of K and V": read}, repeats)


# the most ways decoding_steps times a step
STEP_WAYS = 7


def decoding_steps(engine, rows: int, kv: int, shared: int, repeats: int) -> dict[str, float]:
    from transformers import Cache

    model = engine.model
    # room for a token a step: every way below (at most STEP_WAYS) steps once a round
    room = kv + STEP_WAYS * (repeats + 1) + 4
    cache = Cache(layers=[PreallocatedLayer(room) for _ in range(engine._cache_layers)])
    attn = padding(rows, kv, shared)
    ids = torch.randint(3, model.config.vocab_size, (rows, 1), generator=torch.Generator())
    _, _, kv_heads, dim = attention_shape(model)
    state = {"attn": attn, "last": attn.sum(-1) - 1}
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for layer in cache.layers:  # random KV in place of a prefill: the same work a step
            k, v = random_kv(rows, kv_heads, kv, dim, shared, kv, g)
            layer.update(k.to(model.dtype), v.to(model.dtype))

        def step(grouped: bool, fused: bool = True, cascade: bool = False, lean: bool = False,
                 packed: bool = False, native: bool = False):  # fmt: skip
            hf_cpu.GROUPED_DECODE, hf_cpu.FUSED_PROJECTIONS = grouped, fused
            hf_step.PACKED_DECODE, hf_native.NATIVE_ATTENTION = packed, native
            state["attn"] = torch.cat([state["attn"], attn.new_ones((rows, 1))], dim=1)
            state["last"] = state["last"] + 1
            if lean:
                engine._lean.step(ids[:, 0], state["last"], cache, state["attn"], shared)
                return
            extra = {SHARED_PREFIX: SharedPrefix(shared)} if cascade else {}
            model(
                input_ids=ids,
                attention_mask=state["attn"],
                position_ids=state["last"][:, None],
                past_key_values=cache,
                use_cache=True,
                **extra,
            )

        default = hf_cpu.GROUPED_DECODE, hf_cpu.FUSED_PROJECTIONS, hf_step.PACKED_DECODE
        native = hf_native.NATIVE_ATTENTION
        lean = {}
        if engine._lean is not None:
            lean[f"lean step, cascade ({shared} shared)"] = lambda: step(False, lean=True)
            if engine._lean.packed:
                name = f"lean step on packed weights, cascade ({shared} shared)"
                lean[name] = lambda: step(False, lean=True, packed=True)
            if engine._lean.packed and engine._lean.native is not None:
                name = f"lean step on packed weights, cascade ({shared} shared), compiled"
                lean[name] = lambda: step(False, lean=True, packed=True, native=True)
        assert 4 + len(lean) <= STEP_WAYS
        try:
            return alternate(
                {
                    "SDPA": lambda: step(False),
                    "grouped": lambda: step(True),
                    f"cascade ({shared} shared)": lambda: step(False, cascade=True),
                    "SDPA, projections apart": lambda: step(False, fused=False),
                    **lean,
                },
                repeats,
            )
        finally:
            hf_cpu.GROUPED_DECODE, hf_cpu.FUSED_PROJECTIONS, hf_step.PACKED_DECODE = default
            hf_native.NATIVE_ATTENTION = native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded SmolLM2)")
    ap.add_argument("--rows", type=int, default=48, help="rows of a decoding step")
    ap.add_argument("--kv", type=int, default=470, help="KV positions of a row")
    ap.add_argument(
        "--shared", type=int, default=240, help="first KV positions every row shares (cascade)"
    )
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    engine = HFEngine(
        HFEngineConfig(
            model=resolve_model(args.model),
            device="cpu",
            dtype=args.dtype,
            cpu_threads=args.threads,
        )
    )
    layers, heads, kv_heads, dim = attention_shape(engine.model)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    alone = attention_alone(engine.model, args.rows, args.kv, args.shared, dtype, args.repeats)
    steps = decoding_steps(engine, args.rows, args.kv, args.shared, args.repeats)
    kv_bytes = 2 * layers * args.rows * kv_heads * args.kv * dim * dtype.itemsize
    table = Table(
        title=f"decoding attention, {Path(engine.name).name}: {layers} layers, {heads} query / "
        f"{kv_heads} KV heads of {dim}, {args.rows} rows x {args.kv} KV positions "
        f"({args.shared} shared), "
        f"{args.dtype}, {torch.get_num_threads()} threads (median of {args.repeats}, alternating)"
    )
    for col in ("what", "ms", "KV read GB/s", "SDPA / this"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for name, s in alone.items():
        gbs = f"{kv_bytes / s / 1e9:.1f}"
        table.add_row(f"attention alone: {name}", f"{1e3 * s:.1f}", gbs, f"{alone['SDPA'] / s:.2f}")
    for name, s in steps.items():
        table.add_row(f"decoding step: {name}", f"{1e3 * s:.1f}", "-", f"{steps['SDPA'] / s:.2f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
