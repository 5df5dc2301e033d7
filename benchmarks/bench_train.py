"""Benchmark one verl update against a plain torch forward+backward of the same model and batch.

Both sides see the same random model (a Qwen2 of --size, random weights, the tiny test
tokenizer), the same padded multi-turn batch (prompt + response with a partner turn masked out)
and the same micro-batching, and both finish with a clipped AdamW step. The verl side is
``selfplay.train.workers`` (verl's ActorRolloutRefWorker, FSDP2, PPO-clip loss); the torch side is
transformers + a hand-written policy-gradient loss. Each side runs in a fresh process so that
peak memory is its own (peak RSS on a CPU, peak allocated GPU memory on CUDA).

    .venv/bin/python benchmarks/bench_train.py                       # CPU, size small
    .venv/bin/python benchmarks/bench_train.py --size mid --rows 8   # bigger model
    python benchmarks/bench_train.py --device cuda --size large --rows 32 --micro 8 --dtype bf16

Target: verl tokens/s >= 0.7 x plain torch tokens/s.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

SIZES = {  # hidden, intermediate, layers, heads, kv heads
    "small": (256, 768, 4, 4, 2),
    "mid": (768, 2048, 12, 12, 4),
    "large": (2048, 5632, 24, 16, 4),  # about 1.3 B parameters with a 32k vocabulary
}


def build_model(out: Path, size: str, vocab: int) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.models import build_tiny_model

    tiny = build_tiny_model(out.parent / "tiny_tok", corpus=tokenizer_corpus())
    tok = AutoTokenizer.from_pretrained(tiny)
    hidden, inter, layers, heads, kv = SIZES[size]
    cfg = Qwen2Config(
        vocab_size=max(vocab, len(tok)),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """A padded batch in verl's layout with GRPO-like advantages (groups of 4)."""
    import numpy as np
    import torch

    from selfplay.reward import row_advantages
    from selfplay.train.batch import Rows, collate

    rng = np.random.default_rng(seed)
    prompts, responses, masks = [], [], []
    for i in range(rows):
        p = prompt - (i % 3) * (prompt // 10)
        r = response - (i % 4) * (response // 10)
        prompts.append(rng.integers(3, vocab, p).tolist())
        responses.append(rng.integers(3, vocab, r).tolist())
        m = [1] * r
        m[r // 3 : r // 2] = [0] * (r // 2 - r // 3)  # a partner turn
        masks.append(m)
    data = Rows(
        group_ids=np.arange(rows) // 4,
        prompts=prompts,
        responses=responses,
        masks=masks,
        rollout_logprobs=[[0.0] * len(m) for m in masks],
        rewards=rng.random(rows).astype(np.float32),
    )
    batch = collate(data, pad_id=0)
    adv = torch.from_numpy(row_advantages(data)).float()[:, None]
    batch["advantages"] = adv * batch["response_mask"].float()
    return batch


def peak_mem_gb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_verl(args: dict) -> dict:
    from selfplay.train.config import TrainConfig
    from selfplay.train.workers import LocalWorkers, update_inputs

    cfg = TrainConfig(
        data=Path("unused.parquet"),
        model=args["model"],
        out=Path(args["tmp"]) / "out",
        lr=1e-5,
        micro_batch_size=args["micro"],
        gpus=1 if args["device"] == "cuda" else 0,
        dtype=args["dtype"],
    )
    workers = LocalWorkers(cfg, total_steps=100)
    batch = make_batch(args["rows"], args["prompt"], args["response"], args["vocab"])
    batch["old_log_probs"] = workers.log_probs(batch)["log_probs"]
    train = update_inputs(batch)
    times = []
    for i in range(args["repeats"] + 1):
        _sync(args["device"])
        t0 = time.perf_counter()
        workers.update(train, mini_batch_size=args["rows"], seed=i)
        _sync(args["device"])
        times.append(time.perf_counter() - t0)
    tokens = int(batch["attention_mask"].sum())
    return {
        "tokens": tokens,
        "time_s": statistics.median(times[1:]),
        "peak_gb": peak_mem_gb(args["device"]),
    }


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_torch(args: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = args["device"]
    dtype = torch.bfloat16 if args["dtype"] == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        args["model"], dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    batch = make_batch(args["rows"], args["prompt"], args["response"], args["vocab"])
    batch = {k: v.to(device) for k, v in batch.items()}
    p_len = batch["prompts"].shape[1]
    n_tokens = batch["response_mask"].sum()
    micro = args["micro"]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for s in range(0, args["rows"], micro):
            sl = slice(s, s + micro)
            with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(
                    input_ids=batch["input_ids"][sl],
                    attention_mask=batch["attention_mask"][sl],
                    position_ids=batch["position_ids"][sl],
                ).logits
            logits = logits[:, p_len - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, batch["responses"][sl, :, None])[..., 0]
            mask = batch["response_mask"][sl].float()
            ratio = torch.exp(lp - lp.detach())
            loss = -(ratio * batch["advantages"][sl] * mask).sum() / n_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    times = []
    for _ in range(args["repeats"] + 1):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    tokens = int(batch["attention_mask"].sum())
    return {
        "tokens": tokens,
        "time_s": statistics.median(times[1:]),
        "peak_gb": peak_mem_gb(device),
    }


def main(
    size: str = typer.Option("small", help=f"random Qwen2 size: {', '.join(SIZES)}"),
    model: str | None = typer.Option(None, help="an HF model dir instead of a random one"),
    rows: int = typer.Option(8, help="rows in the batch (one mini-batch)"),
    micro: int = typer.Option(4, help="rows per forward/backward"),
    prompt: int = typer.Option(128, help="prompt tokens (longest row)"),
    response: int = typer.Option(256, help="response tokens (longest row)"),
    vocab: int = typer.Option(8192, help="vocabulary of the random model"),
    repeats: int = typer.Option(3, help="timed updates after one warm-up (median reported)"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    dtype: str = typer.Option("fp32", help="fp32 or bf16 compute"),
    part: str | None = typer.Option(None, hidden=True),
    args_json: str | None = typer.Option(None, hidden=True),
) -> None:
    if part is not None:  # child process: one side only
        args = json.loads(args_json or "{}")
        result = run_verl(args) if part == "verl" else run_torch(args)
        print("RESULT " + json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            t0 = time.perf_counter()
            model = str(build_model(Path(tmp) / f"qwen2_{size}", size, vocab))
            print(
                f"built a random Qwen2 '{size}' in {time.perf_counter() - t0:.1f}s", file=sys.stderr
            )
        from transformers import AutoConfig

        n_vocab = AutoConfig.from_pretrained(model).vocab_size
        args = dict(
            model=model, rows=rows, micro=micro, prompt=prompt, response=response,
            vocab=n_vocab, repeats=repeats, device=device, dtype=dtype, tmp=tmp,
        )  # fmt: skip
        results = {}
        for side in ("torch", "verl"):
            out = subprocess.run(
                [sys.executable, __file__, "--part", side, "--args-json", json.dumps(args)],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                sys.stderr.write(out.stderr[-4000:])
                raise SystemExit(f"the {side} side failed (exit {out.returncode})")
            results[side] = json.loads(line[len("RESULT ") :])
        n_params = _count_params(model)
    tv, tt = results["verl"], results["torch"]
    tps_v, tps_t = tv["tokens"] / tv["time_s"], tt["tokens"] / tt["time_s"]
    mem = "peak GPU GiB" if device == "cuda" else "peak RSS GiB"
    print(
        f"\nmodel {model if 'qwen2_' not in model else size} ({n_params / 1e6:.1f} M params), "
        f"{device} {dtype}, batch {rows} rows x micro {micro}, {tt['tokens']} tokens"
    )
    print(f"| side | s/update | tokens/s | {mem} |")
    print("| --- | --- | --- | --- |")
    print(
        f"| plain torch fwd+bwd+AdamW | {tt['time_s']:.3f} | {tps_t:,.0f} | {tt['peak_gb']:.2f} |"
    )
    print(f"| verl update (selfplay) | {tv['time_s']:.3f} | {tps_v:,.0f} | {tv['peak_gb']:.2f} |")
    print(f"\nratio verl / torch tokens/s: {tps_v / tps_t:.2f} (target >= 0.7)")


def _count_params(model: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in m.parameters())


if __name__ == "__main__":
    typer.run(main)
