"""Check `selfplay iterate` on one GPU: a warm start, expert iteration, the held-out evaluation
played beside each round's games, a SIGKILL inside that shared stage, and the resume.

Run: python scripts/check_gpu_iterate.py [--out DIR] [--rounds 2] [--games 32]
     python scripts/check_gpu_iterate.py --device cpu --gpus 0   # a dry run on the CPU
The repository root is put on sys.path and the run's children get it on PYTHONPATH, so a copied
working tree runs without installing selfplay. A tiny random model is built offline (no hub);
then ``python -m selfplay iterate`` runs as a user would start it: a warm start on scripted
cooperative games (SFT with verl), ``--rounds`` rounds of expert iteration (``--games`` sampled
games a round, the best of each scenario kept, SFT on them), the hf engine on ``--device`` and
verl on ``--gpus`` GPUs, each model's held-out evaluation beside the next round's games.

The run is killed (SIGKILL, its whole process group) once the last round's games file has a few
games, which is inside the stage where that round's games and the previous model's held-out
evaluation play together on one engine; then the same command is run again. The checks: the
resumed run ends; every round has exactly ``--games`` games, none twice; every model has its
held-out result on the same number of games; the rounds' generate records say the evaluation
played beside them; expert iteration kept games and trained on them; every round's checkpoint
loads with transformers, is finite and differs from the model it started from; a third run of the
command finds the run done and plays nothing. It prints the stage table (seconds from the
manifest) and the checks, and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from check_gpu_train import Report, check_model  # noqa: E402  (this script's folder)

from selfplay.manifest import (  # noqa: E402
    ConvertInfo,
    GenerateInfo,
    Manifest,
    WarmStartInfo,
    read_manifest,
)


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def _game_ids(path: Path) -> list[str]:
    return [json.loads(line)["game_id"] for line in path.read_bytes().splitlines() if line.strip()]


def check_round(report: Report, manifest: Manifest, k: int) -> None:
    """Round ``k``'s stage records: the held-out evaluation played beside its games, and expert
    iteration kept games and trained on them."""
    stages = manifest.rounds[k].stages
    generate, convert = stages["generate"].info, stages["convert"].info
    assert isinstance(generate, GenerateInfo) and isinstance(convert, ConvertInfo)
    report.check(
        f"round {k}: the held-out evaluation played beside its games", generate.with_heldout
    )
    report.check(
        f"round {k}: expert iteration kept games and trained on them",
        (convert.games_kept or 0) > 0 and convert.rows_train > 0,
        f"kept {convert.games_kept} of {convert.games}, {convert.rows_train} rows",
    )


def check_heldout(report: Report, manifest: Manifest, rounds: int, eval_scenarios: int) -> None:
    """The start and every round's model have a held-out result, each on ``eval_scenarios``."""
    counts = {k: h.games for k, h in manifest.heldout.items()}
    report.check(
        "every model has its held-out result, on the same games",
        sorted(counts) == list(range(rounds + 1)) and set(counts.values()) == {eval_scenarios},
        str(counts),
    )


def stage_rows(manifest: Manifest, rounds: int) -> list[tuple[str, float, str, str, str]]:
    """The stage table's rows (``Report.stages``): seconds from the manifest, with a note."""
    warm = manifest.warm_start
    assert warm is not None and isinstance(warm.info, WarmStartInfo)
    rows = [("warm start", warm.seconds, "-", "-", f"{warm.info.rows} rows")]
    for k in range(rounds):
        for stage, rec in manifest.rounds[k].stages.items():
            beside = isinstance(rec.info, GenerateInfo) and rec.info.with_heldout
            note = "with the held-out evaluation" if beside else ""
            rows.append((f"r{k} {stage}", rec.seconds, "-", "-", note))
    for k, h in sorted(manifest.heldout.items()):
        note = f"reward {h.reward_mean:.3f}, {h.games} games"
        rows.append((f"heldout {k}", h.seconds, "-", "-", note))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--device", default="cuda", help="hf engine device: cuda or cpu")
    ap.add_argument("--gpus", type=int, default=None, help="iterate --gpus (default: 1 on cuda)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--games", type=int, default=32, help="games a round")
    ap.add_argument("--eval-scenarios", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900, help="seconds for each run at most")
    args = ap.parse_args()
    gpus = args.gpus if args.gpus is not None else (0 if args.device == "cpu" else 1)
    cuda = args.device.startswith("cuda")

    import torch

    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.models import build_tiny_model

    report = Report(cuda=False)  # the stages run in the run's children: no peak from here
    if cuda and not report.check("torch sees a CUDA device", torch.cuda.is_available()):
        report.print()
        return 1
    print(f"device {torch.cuda.get_device_name(0) if cuda else 'cpu'}; iterate --gpus {gpus}")
    tmp = Path(args.out or tempfile.mkdtemp(prefix="check_gpu_iterate_"))
    tmp.mkdir(parents=True, exist_ok=True)
    base = build_tiny_model(tmp / "tiny", corpus=tokenizer_corpus())
    name = "gpu-ei"
    run = tmp / "data" / name
    checkpoints = tmp / "checkpoints" / name
    cmd = [
        sys.executable, "-m", "selfplay", "iterate",
        "--name", name,
        "--data-root", str(tmp / "data"),
        "--checkpoint-root", str(tmp / "checkpoints"),
        "--model", str(base),
        "--device", args.device,
        "--gpus", str(gpus),
        "--algorithm", "expert-iteration",
        "--ei-top-k", "1",
        "--ei-min-reward", "0",
        # a random tiny model never writes a valid action; cloning scripted games at a high
        # learning rate teaches it the tags, so some sampled games get somewhere
        "--warm-start", "scripted:cooperative:32",
        "--warm-start-lr", "1e-3",
        "--warm-start-epochs", "6",
        "--iterations", str(args.rounds),
        "--games-per-iter", str(args.games),
        "--games-per-scenario", "4",
        "--table-size", "3",
        "--max-actions", "10",
        "--max-new-tokens", "48",
        "--lr", "1e-4",
        "--eval-scenarios", str(args.eval_scenarios),
        "--seed", "3",
        "--no-eval-initial",  # the random model's evaluation: a child start for nothing
        "--no-report",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TOKENIZERS_PARALLELISM": "false",
    }
    last = run / f"round_{args.rounds - 1}" / "games.jsonl"
    log = (tmp / "iterate.log").open("ab")

    # 1. start, and kill the whole process group inside the last round's shared stage
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    killed_at = None
    while proc.poll() is None and time.perf_counter() - start < args.timeout:
        if _lines(last) >= 4:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_at = _lines(last)
            break
        time.sleep(0.05)
    first = time.perf_counter() - start
    report.check(
        "first run killed inside the last round's games",
        killed_at is not None,
        f"after {first:.0f} s, {killed_at} games of round {args.rounds - 1} on disk"
        if killed_at is not None
        else f"exit {proc.returncode} after {first:.0f} s (see {tmp / 'iterate.log'})",
    )
    path = run / "manifest.json"
    if killed_at is not None:
        report.check(
            "at the kill, that evaluation not recorded (it shares the stage)",
            not path.exists() or args.rounds - 1 not in read_manifest(path).heldout,
        )

    # 2. the same command again: it resumes and ends
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, stdout=log, stderr=log, timeout=args.timeout)
    second = time.perf_counter() - start
    report.check("resumed run ends", res.returncode == 0, f"exit {res.returncode}, {second:.0f} s")
    if res.returncode != 0:
        print((tmp / "iterate.log").read_text()[-4000:])
        report.print()
        return 1
    manifest = read_manifest(run)

    # 3. what the run holds
    for k in range(args.rounds):
        ids = _game_ids(run / f"round_{k}" / "games.jsonl")
        report.check(
            f"round {k}: {args.games} games, none twice",
            len(ids) == len(set(ids)) == args.games,
            f"{len(ids)} lines, {len(set(ids))} unique",
        )
        check_round(report, manifest, k)
    check_heldout(report, manifest, args.rounds, args.eval_scenarios)
    parent = checkpoints / "warm_start"
    check_model(report, "warm start", parent, base, args.device)
    for k in range(args.rounds):
        model = checkpoints / f"round_{k}"
        check_model(report, f"round {k}", model, parent, args.device)
        parent = model

    # 4. a third run finds it done
    before = sum(_lines(run / f"round_{k}" / "games.jsonl") for k in range(args.rounds))
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, stdout=log, stderr=log, timeout=args.timeout)
    after = sum(_lines(run / f"round_{k}" / "games.jsonl") for k in range(args.rounds))
    report.check(
        "the same command again finds the run done",
        res.returncode == 0 and after == before,
        f"{time.perf_counter() - start:.0f} s, games {before} -> {after}",
    )

    report.stages += stage_rows(manifest, args.rounds)
    print(f"first run (killed) {first:.0f} s, resume {second:.0f} s; working folder {tmp}")
    return 0 if report.print() else 1


if __name__ == "__main__":
    sys.exit(main())
