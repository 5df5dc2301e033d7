"""Several training seeds of one recipe (``selfplay iterate --seeds 0,1,2``) and the report over
them.

Each seed is a run of its own, ``data/NAME/seed-K`` with its checkpoints under
``checkpoints/NAME/seed-K``, run one after the other on one machine; each resumes on its own, so
a killed multi-seed command re-run finishes the seeds left. ``seeds_report`` then writes
``data/NAME/SEEDS.md`` and ``seeds.json``: per seed the start, final and ``proposer`` rewards
with the paired differences; the mean final reward over seeds with a 95% t-interval over seeds;
and the pooled paired differences: per scenario the mean over seeds of final minus start (or
minus ``proposer``), with a 95% t-interval over scenarios (the scenarios are the same for every
seed, so they, not the seed-scenario pairs, are the independent units). Split: the test split
where every seed played it, else the dev split's final held-out evaluation (said so).
"""

from __future__ import annotations

import json
from pathlib import Path

from selfplay.errors import UserError
from selfplay.evaluate.compare import load_games
from selfplay.evaluate.learned import PROPOSER
from selfplay.manifest import read_manifest
from selfplay.metrics import mean_ci


class SeedsError(UserError, ValueError):
    """A --seeds value or a multi-seed folder that cannot be reported."""


def parse_seeds(text: str) -> tuple[int, ...]:
    """'0,1,2' -> (0, 1, 2): distinct non-negative integers, or a ``SeedsError`` saying why."""
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SeedsError(f"--seeds takes integers separated by commas, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise SeedsError(f"--seeds takes distinct non-negative integers, got {text!r}")
    return seeds


def seed_name(seed: int) -> str:
    return f"seed-{seed}"


def _files(run_dir: Path) -> tuple[str, dict[str, Path]]:
    """(split, {"start", "final", "proposer": games file}) of one seed's run."""
    manifest = read_manifest(run_dir)
    if manifest.test:
        from selfplay.iterate.report import test_files

        final, start, base = test_files(manifest)
        files = {"final": final, "start": start, PROPOSER: base.get(PROPOSER)}
        return "test", {k: v for k, v in files.items() if v is not None and v.is_file()}
    held = manifest.heldout
    if not held:
        raise SeedsError(f"{run_dir}: no held-out evaluation to report")
    folder = lambda h: Path(h.path or "") / "games"  # noqa: E731
    files = {
        "final": folder(held[max(held)]) / "model-model.jsonl",
        "start": folder(held[min(held)]) / "model-model.jsonl",
    }
    if PROPOSER in manifest.baselines:
        files[PROPOSER] = folder(manifest.baselines[PROPOSER]) / f"baseline-{PROPOSER}.jsonl"
    return "dev", {k: v for k, v in files.items() if v.is_file()}


def _fmt(m: tuple[float, float, float]) -> str:
    return f"{m[0]:+.3f} [{m[1]:+.3f}, {m[2]:+.3f}]"


def seeds_report(parent: Path, seeds: tuple[int, ...]) -> Path:
    """Write ``parent/SEEDS.md`` and ``parent/seeds.json`` over the seeds' runs; the path."""
    per_seed, splits = {}, set()
    for s in seeds:
        split, files = _files(parent / seed_name(s))
        splits.add(split)
        per_seed[s] = {k: load_games(v, f"seed {s} {k}").rewards for k, v in files.items()}
    split = "test" if splits == {"test"} else "dev"
    rows, pooled = [], {}
    for against in ("start", PROPOSER):
        by_scenario: dict[str, list[float]] = {}
        for r in per_seed.values():
            if against in r and "final" in r:
                for sid in r["final"].keys() & r[against].keys():
                    by_scenario.setdefault(sid, []).append(r["final"][sid] - r[against][sid])
        if by_scenario:
            pooled[against] = (
                mean_ci(sum(v) / len(v) for v in by_scenario.values()),
                len(by_scenario),
            )
    for s, r in per_seed.items():
        row = {"seed": s}
        for k, v in r.items():
            row[k] = sum(v.values()) / len(v)
        for against in ("start", PROPOSER):
            if against in r and "final" in r:
                common = r["final"].keys() & r[against].keys()
                row[f"final - {against}"] = mean_ci(
                    r["final"][sid] - r[against][sid] for sid in sorted(common)
                )
        rows.append(row)
    finals = [row["final"] for row in rows if "final" in row]
    over_seeds = mean_ci(finals) if len(finals) > 1 else None
    md = [
        f"# {parent.name}: {len(seeds)} training seeds",
        "",
        f"Split: **{split}**"
        + ("" if split == "test" else " (not every seed played the test split)")
        + ". Rewards are means over the split's scenarios; differences are paired by scenario "
        "(95% t-interval).",
        "",
        "| seed | start | final | proposer | final - start | final - proposer |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [f"{row[k]:.3f}" if k in row else "" for k in ("start", "final", PROPOSER)]
        diffs = [_fmt(row[k]) if k in row else "" for k in ("final - start", f"final - {PROPOSER}")]
        md.append(f"| {row['seed']} | " + " | ".join(cells + diffs) + " |")
    md.append("")
    if over_seeds is not None:
        md.append(f"Final reward over seeds: {over_seeds[0]:.3f} [{over_seeds[1]:.3f}, "
                  f"{over_seeds[2]:.3f}] (95% t-interval over {len(finals)} seeds).")  # fmt: skip
        md.append("")
    for against, (m, n) in pooled.items():
        md.append(f"Pooled final - {against}: {_fmt(m)} over {n} scenarios (per scenario the "
                  "mean over seeds).")  # fmt: skip
    out = parent / "SEEDS.md"
    out.write_text("\n".join(md) + "\n")
    data = {
        "split": split,
        "seeds": rows,
        "final_over_seeds": over_seeds,
        "pooled": {k: {"mean_ci": m, "scenarios": n} for k, (m, n) in pooled.items()},
    }
    (parent / "seeds.json").write_text(json.dumps(data, indent=1) + "\n")
    return out
