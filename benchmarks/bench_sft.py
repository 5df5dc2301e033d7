"""SFT throughput: `selfplay sft`'s verl update against a plain torch loop on the same rows.

Builds behaviour-cloning rows of scripted cooperative 3x3 games for the embedded SmolLM2-135M
(the rows `selfplay sft --teacher scripted:cooperative` trains on), then times, on the same rows:

- verl: `train.sft.train_sft` (verl's SFT loss on the in-process FSDP2 worker), fp32 and bf16;
- torch: a plain loop (AdamW, the same mini- and micro-batches, loss on mask-1 tokens only),
  fp32 and bf16 autocast;
- LoRA: a verl variant with a ``-loraR`` suffix (``verl-bf16-lora16``) trains rank-R adapters on
  every linear layer (``--lora-rank``) instead of every weight;
- LM head: verl variants run it at the trained positions only (``lm_head_positions``); an
  ``-allhead`` suffix (``verl-fp32-allhead``) runs it at every position, as verl does;
- attention: verl variants run ``attn_implementation="auto"`` (``sdpa_packed``: one causal SDPA
  call per packed row); a ``-sdpa`` suffix (``verl-bf16-sdpa``) runs transformers' ``sdpa``, which
  attends over the whole packed micro-batch through a block-diagonal mask.

Prints tokens/s (all tokens of the rows, prompt and response) per variant and the process's peak
RSS (run one variant per process, ``--only``, to compare memory). Run it alone on a quiet
machine: `python benchmarks/bench_sft.py [--rows 32] [--table-size 4]
[--only verl-bf16,verl-bf16-sdpa]` (4x4 games give rows about twice as long as 3x3's).
"""

from __future__ import annotations

import argparse
import logging
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch


def torch_loop(model_dir: str, rows, pad_id: int, mini: int, micro: int, bf16: bool) -> float:
    from transformers import AutoModelForCausalLM

    from selfplay.train.batch import collate

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens = 0
    start = time.perf_counter()
    for m0 in range(0, len(rows) - mini + 1, mini):
        opt.zero_grad()
        trained = sum(sum(rows.masks[i]) for i in range(m0, m0 + mini))
        for u0 in range(m0, m0 + mini, micro):
            b = collate(rows.select(range(u0, u0 + micro)), pad_id)
            p = b["prompts"].shape[1]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(
                    input_ids=b["input_ids"],
                    attention_mask=b["attention_mask"],
                    position_ids=b["position_ids"],
                )
            logits = out.logits[:, p - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None])[..., 0]
            loss = -(lp * b["response_mask"]).sum() / trained
            loss.backward()
            tokens += int(b["attention_mask"].sum())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return tokens / (time.perf_counter() - start)


def waste(lengths: list[int], micro: int, seed: int = 0) -> tuple[float, float]:
    """For micro-batches of ``micro`` rows in a random order: the fraction of a padded batch that
    is padding, and the fraction of attention scores that packing under transformers' ``sdpa``
    computes across rows (block-diagonal mask over the packed sequence; ``sdpa_packed``: 0)."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(lengths))
    lens = np.asarray(lengths)[order]
    pad = cells = across = scores = 0
    for i in range(0, len(lens) - micro + 1, micro):
        b = lens[i : i + micro]
        pad += len(b) * b.max() - b.sum()
        cells += len(b) * b.max()
        scores += b.sum() ** 2
        across += b.sum() ** 2 - (b**2).sum()
    return pad / cells, across / scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--mini", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--table-size", type=int, default=3)
    ap.add_argument("--only", default="verl-fp32,verl-bf16,torch-fp32,torch-bf16")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from selfplay.iterate.warm_start import SFTConfig, build_rows
    from selfplay.models import resolve_model
    from selfplay.players.llm import load_chat_format
    from selfplay.train.config import TrainConfig
    from selfplay.train.sft import train_sft
    from selfplay.train.trainer import load_rows

    model = resolve_model(None)
    work = Path(tempfile.mkdtemp(prefix="bench_sft_"))
    cfg = SFTConfig(
        model=model,
        out=work / "rows",
        teacher="scripted:cooperative",
        num_games=args.rows // 2,
        table_size=args.table_size,
    )
    rows_path, _ = build_rows(cfg, load_chat_format(model))
    results = {}
    for variant in args.only.split(","):
        engine, dtype, *options = variant.split("-")
        lora = [o for o in options if o.startswith("lora")]
        rank = int(lora[0].removeprefix("lora")) if lora else 0
        tcfg = TrainConfig(
            attn_implementation="sdpa" if "sdpa" in options else "auto",
            lm_head_positions="all" if "allhead" in options else "trained",
            lora_rank=rank,
            lora_alpha=2 * rank or 16,
            data=rows_path,
            model=model,
            out=work / variant,
            mini_batch_size=args.mini,
            batch_size=args.rows,
            micro_batch_size=args.micro,
            dtype=dtype,
            lr=1e-4,
            save_verl_checkpoint=False,
        )
        if engine == "verl":
            res = train_sft(tcfg)
            results[variant] = sum(s.tokens for s in res.steps) / sum(s.time_s for s in res.steps)
        else:
            rows, pad_id = load_rows(tcfg, groups=False)
            results[variant] = torch_loop(
                model, rows, pad_id, args.mini, args.micro, dtype == "bf16"
            )
        print(f"{variant}: {results[variant]:.0f} tokens/s", flush=True)
    rows, _ = load_rows(tcfg, groups=False)
    lengths = [len(p) + len(r) for p, r in zip(rows.prompts, rows.responses, strict=True)]
    mean = sum(lengths) / len(lengths)
    shutil.rmtree(work, ignore_errors=True)
    threads = torch.get_num_threads()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n = args.table_size
    print(f"\nSFT, {args.rows} rows of cooperative {n}x{n} games ({mean:.0f} tokens a row),")
    print(f"SmolLM2-135M, {threads} threads, mini-batch {args.mini}, micro-batch {args.micro}")
    print(f"peak RSS of this process: {peak:.0f} MB")
    padding, across = waste(lengths, args.micro)
    print(
        f"micro-batches of {args.micro} in a random order: padding {padding:.1%} of a padded "
        f"batch; packed under sdpa, {across:.1%} of attention scores across rows (sdpa_packed: 0)"
    )
    print("| variant | tokens/s |\n|---|---|")
    for k, v in results.items():
        print(f"| {k} | {v:.0f} |")


if __name__ == "__main__":
    main()
