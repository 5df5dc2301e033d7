"""Check the hf engine on this machine's GPU: the dtype rule, games played, token-exact records.

Run: python scripts/check_gpu.py [--model DIR] [--games 16] [--out DIR]
Without --model, a tiny random model is built offline (no hub). The script plays ``--games``
self-play games through ``selfplay generate``'s engine on cuda with ``--dtype auto``, then checks
every record: the dtype the rule picked (bf16 on a GPU that has it), the seats' token lists
aligned, and the behaviour log-probs of the sampled tokens against one fresh forward pass of the
same model over each seat's whole token list (their difference: batching, KV cache and
bf16 rounding). It prints a table and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--games", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from selfplay.engines import HFEngineConfig
    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.generate.config import GenerateConfig
    from selfplay.generate.runner import run_generate
    from selfplay.hardware import resolve_dtype
    from selfplay.models import build_tiny_model
    from selfplay.records import iter_game_records
    from selfplay.seats import SamplingParams

    tmp = Path(args.out or tempfile.mkdtemp(prefix="check_gpu_"))
    model = args.model or str(build_tiny_model(tmp / "tiny", corpus=tokenizer_corpus()))
    dtype = resolve_dtype("auto", args.device)
    cfg = GenerateConfig(
        out=tmp / "games",
        num_games=args.games,
        model=model,
        table_size=3,
        max_actions=10,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=32),
    )
    start = time.perf_counter()
    result = run_generate(cfg, HFEngineConfig(model=model, device=args.device))
    seconds = time.perf_counter() - start
    records = list(iter_game_records(cfg.games_path))

    ref = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32
    ).to(args.device)
    ref.eval()
    worst, own_tokens, aligned = 0.0, 0, True
    for record in records:
        for seat in record.tokens:
            if seat is None:
                continue
            aligned &= len(seat.token_ids) == len(seat.mask) == len(seat.logprobs)
            if len(seat.token_ids) < 2:
                continue
            ids = torch.tensor([seat.token_ids], dtype=torch.long, device=args.device)
            with torch.no_grad():
                logits = ref(ids).logits.float()
            lp = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            for i in range(1, len(seat.token_ids)):
                if seat.mask[i]:
                    own_tokens += 1
                    worst = max(worst, abs(lp[i - 1].item() - seat.logprobs[i]))
    # sampled at temperature 1, so the behaviour log-probs are the model's own: they agree up to
    # the dtype's rounding (bf16 keeps 8 bits of mantissa)
    tolerance = 0.25 if dtype == "bf16" else 1e-3
    rows = [
        ("device", torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"),
        ("dtype picked by --dtype auto", dtype),
        ("games played / on disk", f"{result.stats.played} / {len(records)}"),
        ("wall time (s), games/s", f"{seconds:.1f}, {len(records) / seconds:.2f}"),
        ("seat token lists aligned", str(aligned)),
        ("own tokens checked", str(own_tokens)),
        ("max |behaviour - fresh forward| log-prob", f"{worst:.4f} (tolerance {tolerance})"),
    ]
    for k, v in rows:
        print(f"{k:45s} {v}")
    ok = aligned and len(records) == args.games and own_tokens > 0 and worst <= tolerance
    ok &= dtype == "bf16" or not args.device.startswith("cuda")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
