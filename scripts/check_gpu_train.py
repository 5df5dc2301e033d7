"""Check the one-GPU training path end to end: sft, generate, convert and verl GRPO on cuda.

Run: python scripts/check_gpu_train.py [--out DIR] [--games 32] [--steps 2] [--sft-epochs 6]
     python scripts/check_gpu_train.py --device cpu --gpus 0 --dtype fp32   # a dry run on the CPU
The repository root is put on sys.path, so a copied working tree runs without installing selfplay.
A tiny random model is built offline (no hub); then the project's own stage entry points run in
this process, chained as ``selfplay iterate`` chains them:
- ``sft`` warm-starts it on 32 scripted games (cooperative and no-talk) with verl's SFT loss, at a
  high learning rate: a random tiny model never writes a valid action, after this some are;
- ``generate`` plays ``--games`` self-play games with it (3x3 tables, 4 games a scenario) through
  the hf engine on ``--device``;
- ``convert`` turns them into GRPO rows, the seat whose invalid actions end a game getting reward
  -1 (``invalid_penalty``), so rows differ within a scenario before any game reaches agreement;
- ``train`` runs verl 0.9.1's GRPO update on them for ``--steps`` steps with ``--gpus`` (default 1
  on cuda: the in-process launcher on one GPU), ``train-kl`` one step with a KL loss (a
  reference worker too) and, where ``TrainConfig`` has ``lora_rank``, ``train-lora`` one step of
  rank-8 LoRA adapters (merged into the exported model).
It checks that each new model directory loads with transformers and runs on the device, and that
its weights are finite and differ from the model it started from; that the step metrics are
finite, the gradients not zero and the SFT loss lower at the end; and, on cuda, that every stage
allocated GPU memory and verl's platform was cuda. It prints a table (stage, seconds, tokens/s,
peak GPU memory) and the checks, and exits 1 when a check fails; a stage that raises is reported
with its traceback, and the stages that do not need its output still run.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Report:
    """The stage table and the list of checks."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.stages: list[tuple[str, float, str, str, str]] = []
        self.checks: list[tuple[str, bool, str]] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        return bool(ok)

    def stage(self, name: str, run, on_device: bool = True):
        """Run ``run() -> (result, tokens, note)`` as one stage, timed, with its peak GPU memory
        (checked to be above 0 for an ``on_device`` stage on cuda); None on an exception."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        print(f"--- stage {name}", flush=True)
        start = time.perf_counter()
        try:
            result, tokens, note = run()
        except Exception as e:  # report it and go on with the stages that do not need it
            traceback.print_exc()
            self.stages.append((name, time.perf_counter() - start, "-", "-", f"FAILED: {e!r}"[:90]))
            self.check(f"{name}: ran", False, f"{type(e).__name__}: {e}"[:300])
            return None
        seconds = time.perf_counter() - start
        peak = "-"
        if self.cuda:
            torch.cuda.synchronize()
            peak_bytes = torch.cuda.max_memory_allocated()
            peak = f"{peak_bytes / 2**20:.1f}"
            if on_device:
                self.check(f"{name}: allocated GPU memory", peak_bytes > 0, f"{peak} MiB peak")
        rate = f"{tokens / seconds:.0f}" if tokens else "-"
        self.stages.append((name, seconds, rate, peak, note))
        self.check(f"{name}: ran", True)
        return result

    def print(self) -> bool:
        print()
        print(f"{'stage':10s} {'seconds':>8s} {'tokens/s':>9s} {'peak GPU MiB':>13s}  note")
        for name, seconds, rate, peak, note in self.stages:
            print(f"{name:10s} {seconds:8.1f} {rate:>9s} {peak:>13s}  {note}")
        print()
        for name, ok, detail in self.checks:
            print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
        ok = all(ok for _, ok, _ in self.checks)
        print("OK" if ok else "FAILED")
        return ok


def finite(values) -> bool:
    return all(v is None or math.isfinite(v) for v in values)


def check_model(report: Report, name: str, model_dir: Path, base: Path, device: str) -> None:
    """The directory loads with transformers, runs, and its weights are finite and moved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        report.check(f"{name}: {model_dir.name} loads with transformers", False, repr(e)[:300])
        return
    old = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    state = new.state_dict()
    diff = max((state[k] - old[k]).abs().max().item() for k in old)
    report.check(f"{name}: {model_dir.name} loads with transformers", set(state) == set(old))
    report.check(
        f"{name}: weights finite", all(torch.isfinite(v).all().item() for v in state.values())
    )
    report.check(f"{name}: weights differ from {base.name}", diff > 0, f"max |delta| {diff:.3g}")
    new.to(device).eval()
    with torch.no_grad():
        logits = new(torch.tensor([[1, 2, 3, 4]], device=device)).logits
    report.check(f"{name}: forward pass on {device} finite", torch.isfinite(logits).all().item())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--games", type=int, default=32, help="self-play games to generate")
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps (one mini-batch each)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (generation and checks)")
    ap.add_argument("--gpus", type=int, default=None, help="train/sft --gpus (default: 1 on cuda)")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU), fp32 or bf16")
    ap.add_argument("--sft-epochs", type=int, default=6, help="epochs of the warm start")
    args = ap.parse_args()
    gpus = args.gpus if args.gpus is not None else (0 if args.device == "cpu" else 1)
    cuda = args.device.startswith("cuda")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("verl", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import torch
    import transformers

    from selfplay.convert import ConvertConfig, convert
    from selfplay.engines import HFEngineConfig
    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.generate.config import GenerateConfig
    from selfplay.generate.runner import run_generate
    from selfplay.hardware import resolve_dtype
    from selfplay.iterate.warm_start import SFTConfig, sft
    from selfplay.models import build_tiny_model
    from selfplay.records import iter_game_records
    from selfplay.seats import SamplingParams
    from selfplay.train import TrainConfig, train
    from selfplay.train.compat import installed_verl_version

    report = Report(cuda)
    if cuda and not report.check("torch sees a CUDA device", torch.cuda.is_available()):
        report.print()
        return 1
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(
        f"device {device_name}; torch {torch.__version__}, transformers {transformers.__version__},"
        f" verl {installed_verl_version()}; train/sft --gpus {gpus}, "
        f"dtype {args.dtype} -> {resolve_dtype(args.dtype, 'cuda' if gpus else 'cpu')}",
        flush=True,
    )
    tmp = Path(args.out or tempfile.mkdtemp(prefix="check_gpu_train_"))
    tmp.mkdir(parents=True, exist_ok=True)

    base = report.stage(
        "tiny model",
        lambda: (build_tiny_model(tmp / "tiny", corpus=tokenizer_corpus()), 0, "built offline"),
        on_device=False,
    )
    if base is None:
        report.print()
        return 1

    def sft_stage():
        # a random tiny model never writes a valid action; cloning scripted games at a high
        # learning rate teaches it the tags ([message] is valid whatever follows), so some
        # generated games get past the first seat and their rows differ within a scenario
        cfg = SFTConfig(
            model=str(base),
            out=tmp / "sft",
            teacher="scripted:cooperative:16,scripted:no-talk:16",
            num_games=32,
            table_size=3,
            lr=1e-2,
            epochs=args.sft_epochs,
            mini_batch_size=8,
            micro_batch_size=8,
            dtype=args.dtype,
            gpus=gpus,
        )
        result = sft(cfg)
        steps = result.steps
        losses = [s.loss for s in steps]
        report.check(
            "sft: updates run", len(steps) >= 1, f"{result.rows} rows, {steps[-1].step} updates"
        )
        report.check(
            "sft: metrics finite",
            finite(v for s in steps for v in (s.loss, s.grad_norm)),
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        )
        report.check("sft: loss went down", losses[-1] < losses[0])
        report.check("sft: grad norm > 0", all(s.grad_norm > 0 for s in steps))
        seconds = sum(s.time_s for s in steps)
        tokens = sum(s.tokens for s in steps)
        note = (
            f"{steps[-1].step} updates, {tokens / max(seconds, 1e-9):.0f} tokens/s in the updates"
        )
        return result, tokens, note

    tuned = report.stage("sft", sft_stage)
    if tuned is not None:
        check_model(report, "sft", tuned.model_dir, base, args.device)
    policy = tuned.model_dir if tuned is not None else base

    gen = GenerateConfig(
        out=tmp / "games",
        num_games=args.games,
        model=str(policy),
        table_size=3,
        max_actions=10,
        games_per_scenario=4,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=32),
    )

    def generate():
        result = run_generate(
            gen, HFEngineConfig(model=str(policy), device=args.device, dtype=args.dtype)
        )
        records = list(iter_game_records(gen.games_path))
        report.check("generate: games on disk", len(records) == args.games, str(len(records)))
        outcomes = dict(result.stats.outcomes)
        return records, result.stats.generated_tokens, f"{len(records)} games {outcomes}"

    records = report.stage("generate", generate)

    # the seat whose invalid actions end a game gets -1 (its partner 0): rows differ within a
    # scenario even where no game reaches an agreement
    rows_cfg = ConvertConfig(games=gen.games_path, out=tmp / "rows", invalid_penalty=1.0)

    def convert_stage():
        s = convert(rows_cfg)
        return s, 0, f"{s.rows_train} train rows in {s.groups_written} groups"

    summary = (
        report.stage("convert", convert_stage, on_device=False) if records is not None else None
    )

    def train_stage(name: str, steps_wanted: int, kl_coef: float = 0.0, **extra):
        mini = max(2, summary.rows_train // steps_wanted)
        settings = {
            "lr": 1e-4,  # large enough that one step visibly moves the fp32 master weights
            "kl_coef": kl_coef,  # > 0: a reference worker (on a GPU, verl's forward-only engine)
            "save_verl_checkpoint": kl_coef == 0,
            **extra,
        }
        cfg = TrainConfig(
            data=Path(summary.train_path),
            model=str(policy),
            out=tmp / name,
            gpus=gpus,
            batch_size=mini,
            mini_batch_size=mini,
            micro_batch_size=4,
            dtype=args.dtype,
            **settings,
        )
        result = train(cfg)
        steps = result.steps
        numbers = [
            v
            for s in steps
            for v in (s.pg_loss, s.loss, s.ppo_kl, s.clip_frac, s.grad_norm, s.entropy, s.kl)
        ]
        report.check(f"{name}: steps run", len(steps) >= 1, f"{len(steps)} step(s) of {mini} rows")
        report.check(
            f"{name}: metrics finite", finite(numbers), "; ".join(s.line(len(steps)) for s in steps)
        )
        report.check(f"{name}: grad norm > 0", all(s.grad_norm > 0 for s in steps))
        report.check(f"{name}: metrics.json written", result.metrics_path.is_file())
        if kl_coef:
            kls = [s.kl for s in steps]
            report.check(f"{name}: KL loss reported", None not in kls, f"kl {kls}")
        else:
            ckpt = result.checkpoint_dir
            report.check(
                f"{name}: verl checkpoint written",
                ckpt is not None and any(ckpt.rglob("*.pt")),
                str(ckpt),
            )
        if cuda:
            from verl.utils.device import get_device_name as platform_device_name

            device = platform_device_name()
            report.check(f"{name}: verl's platform device is cuda", device == "cuda", device)
        seconds = sum(s.time_s for s in steps)
        tokens = sum(s.tokens for s in steps)
        note = f"{len(steps)} step(s), {tokens / max(seconds, 1e-9):.0f} tokens/s in the steps"
        return result, tokens, note

    variants = [("train", args.steps, 0.0, {}), ("train-kl", 1, 0.01, {})]
    if "lora_rank" in TrainConfig.model_fields:  # peft adapters, merged into the exported model
        variants.append(("train-lora", 1, 0.0, {"lora_rank": 8, "lr": 1e-3}))
    for name, steps_wanted, kl_coef, extra in variants:
        if summary is None:
            break
        grpo = report.stage(
            name, lambda n=name, k=steps_wanted, c=kl_coef, e=extra: train_stage(n, k, c, **e)
        )
        if grpo is not None:
            check_model(report, name, grpo.model_dir, Path(policy), args.device)
    print(f"outputs under {tmp}")
    return 0 if report.print() else 1


if __name__ == "__main__":
    sys.exit(main())
