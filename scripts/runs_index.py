"""docs/runs/README.md, the results page: one row per published run (docs/runs/NAME), written from
each run's own files, so that the page says what the runs say and nothing else.

    python scripts/runs_index.py           # rewrite docs/runs/README.md
    python scripts/runs_index.py --check   # exit 1 when the committed page is not what this writes

Per run: the question (the row of recipes/README.md's table that names its recipe; a run without
a recipe borrows the question of the recipe its name extends, marked as a variant), the recipe
(docs/runs/NAME/RECIPE names it), the held-out split, the training seeds, the final model minus
the model it started from, paired by scenario with its 95% t-interval (recomputed from
heldout/warm_start.jsonl.gz and heldout/final.jsonl.gz with ``selfplay.evaluate.compare``; from
REPORT.md where the run published no games), the time its stages took (manifest), the CPU where
the manifest records one, and the commit the run started at.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "runs"
RECIPES = ROOT / "recipes"

HEADER = """\
# Results: every published run

Written by `python scripts/runs_index.py` from the run folders beside this page (each run's
`manifest.json`, `RECIPE` note, held-out games and `REPORT.md`); a test checks that the page is
what the script writes and that it lists every folder. Do not edit it by hand.

Read it with the [learning audit's corrections](../experiments/index.md) in mind: every run
below but ask-cap2 played the **same dev held-out scenarios (eval seed 7)** with **one training
seed**, and about ten learn and twenty ask variants were tried on that one set, so a single
interval above zero there is not a finding. They predate the test split (`selfplay iterate
--test-scenarios`, `selfplay eval --split test`) and `--seeds`, which ask-cap2 and new runs use
for their headline ([recipes and splits](../guide/recipes.md)). A multi-seed run's row is
pooled over its seeds (per scenario the mean over seeds, then a t-interval over scenarios): an
interval that does not show how much the seeds disagree; its SEEDS.md has each seed's row.

Columns: **final - start** is the final model's held-out reward minus the model it started from
(the warm-started one), paired by scenario, mean [95% t-interval], over **n** scenarios;
**stage time** is the sum of the run's recorded stages (warm start, generate, convert, train and
each held-out evaluation not played beside a round's games), not counting pauses between resumes;
**audit** is what the learning audit of 2026-11-28 found about the runs it examined, the one
column not read from the run's files. No manifest here records its CPU (a CPU column appears
when one does); the write-ups in [experiments](../experiments/index.md) name it.
"""


def questions(recipes: Path = RECIPES) -> dict[str, str]:
    """recipe name -> what it asks, from recipes/README.md's table."""
    out: dict[str, str] = {}
    for line in (recipes / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("recipe", "") or set(cells[0]) <= set("-"):
            continue
        for name in cells[0].split(","):
            out[name.strip()] = cells[1]
    return out


def recipe_of(run: Path) -> str | None:
    note = run / "RECIPE"
    if not note.is_file():
        return None
    first = note.read_text().splitlines()[0]
    return Path(first.removeprefix("recipe: ").strip()).stem


def question(name: str, recipe: str | None, asks: dict[str, str]) -> str:
    if recipe and recipe in asks:
        return asks[recipe]
    if name in asks:
        return asks[name]
    family = max((r for r in asks if name.startswith(r)), key=len, default=None)
    if family:
        return f"a variant of `{family}`: {asks[family]}"
    return f"({name}: no recipe names its question)"


def paired_difference(run: Path) -> tuple[str, str]:
    """(``+m [lo, hi]``, n) for final minus start, from the published held-out games, else from
    the report's paired table."""
    warm, final = run / "heldout" / "warm_start.jsonl.gz", run / "heldout" / "final.jsonl.gz"
    if warm.is_file() and final.is_file():
        from selfplay.evaluate.compare import load_games, paired

        p = paired(load_games(warm, "start"), load_games(final, "final"))
        return f"{p.mean:+.3f} [{p.low:+.3f}, {p.high:+.3f}]", str(p.scenarios)
    report = run / "REPORT.md"
    if report.is_file():
        m = re.search(
            r"^\| after \d+ rounds - start[^|]*\| (\d+) \| ([^|]+?) \|",
            report.read_text(),
            re.MULTILINE,
        )
        if m:
            return f"{m.group(2)} (REPORT.md; no games published)", m.group(1)
    return "—", "—"


def stage_seconds(manifest: dict) -> float:
    total = 0.0
    for key in ("warm_start", "heldout_initial"):
        total += (manifest.get(key) or {}).get("seconds") or 0.0
    beside = set()
    for k, rnd in (manifest.get("rounds") or {}).items():
        for stage in (rnd.get("stages") or {}).values():
            total += stage.get("seconds") or 0.0
        if ((rnd.get("stages") or {}).get("generate") or {}).get("info", {}).get("with_heldout"):
            beside.add(k)  # model k's evaluation played beside round k's games: counted there
    for k, entry in (manifest.get("heldout") or {}).items():
        if k not in beside:
            total += entry.get("seconds") or 0.0
    return total


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def split(run: Path, manifest: dict | None) -> str:
    seed = (manifest or {}).get("config", {}).get("eval_seed")
    if seed is None and (run / "REPORT.md").is_file():
        m = re.search(r"\(eval seed (\d+)", (run / "REPORT.md").read_text())
        seed = m and int(m.group(1))
    return f"dev (eval seed {seed})" if seed is not None else "dev"


def provenance(manifest: dict) -> tuple[str, str]:
    """(the CPU the manifest records, or "", the commit the run started at, short)."""
    cpu = manifest.get("cpu") or manifest.get("versions", {}).get("cpu") or ""
    return cpu, (manifest.get("git_commit") or "—")[:7]


def seeds_row(run: Path, asks: dict[str, str]) -> list[str]:
    """A multi-seed run (``iterate --seeds``: seeds.json, seed-K/): its split, its seeds, the
    pooled paired difference (per scenario the mean over seeds), the seeds' stage time summed."""
    summary = json.loads((run / "seeds.json").read_text())
    manifests = [json.loads(p.read_text()) for p in sorted(run.glob("seed-*/manifest.json"))]
    pooled = summary["pooled"]["start"]
    mean, low, high = pooled["mean_ci"]
    seeds = [str(s["seed"]) for s in summary["seeds"]]
    cpu, commit = provenance(manifests[0] if manifests else {})
    recipe = recipe_of(run)
    return [
        f"[{run.name}]({run.name}/SEEDS.md)",
        question(run.name, recipe, asks),
        f"`recipes/{recipe}.toml`" if recipe else "no recipe",
        summary["split"],
        f"{len(seeds)} (seeds {', '.join(seeds)})",
        f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] (pooled over seeds)",
        str(pooled["scenarios"]),
        AUDIT.get(run.name, ""),
        minutes(sum(stage_seconds(m) for m in manifests)),
        cpu,
        commit,
    ]


def row(run: Path, asks: dict[str, str]) -> list[str]:
    if (run / "seeds.json").is_file():
        return seeds_row(run, asks)
    manifest_file = run / "manifest.json"
    manifest = json.loads(manifest_file.read_text()) if manifest_file.is_file() else None
    name = run.name
    recipe = recipe_of(run)
    diff, n = paired_difference(run)
    if manifest:
        seeds = f"1 (seed {manifest['config'].get('seed', '?')})"
        time = minutes(stage_seconds(manifest))
        cpu, commit = provenance(manifest)
    else:
        seeds, time, cpu, commit = "1 (not recorded)", "—", "", "— (no manifest)"
    report = f"[{name}]({name}/REPORT.md)" if (run / "REPORT.md").is_file() else name
    return [
        report,
        question(name, recipe, asks),
        f"`recipes/{recipe}.toml`" if recipe else "no recipe",
        split(run, manifest),
        seeds,
        diff,
        n,
        AUDIT.get(name, ""),
        time,
        cpu,
        commit,
    ]


# What the learning audit of 2026-11-28 found about a run (docs/experiments/index.md): the one
# column of this page not read from the run's own files.
AUDIT = {
    "ask-advice": "not learned asking: the final model plays scripted advised-asker or advised "
    "action for action; 93% of the gain is the view bug ([correction](../experiments/asking.md))",
    "ask-advice-grpo": "plays scripted advised-asker in 96/96 games; the gain is the view bug "
    "([correction](../experiments/asking.md))",
    "ask-advice-guided": "plays scripted advised-asker; the gain is the view bug "
    "([correction](../experiments/asking.md))",
    "learn-explain": "not established: sign test p=0.17, one of ~10 learn variants on this set, "
    "below its teacher by 0.069 ([correction](../experiments/learning.md))",
}


COLUMNS = [
    "run",
    "question",
    "recipe",
    "split",
    "seeds",
    "final - start",
    "n",
    "audit",
    "stage time",
    "CPU",
    "commit",
]


def render(runs: Path = RUNS, recipes: Path = RECIPES) -> str:
    asks = questions(recipes)
    folders = sorted(p for p in runs.iterdir() if p.is_dir())
    rows = [row(run, asks) for run in folders]
    keep = [i for i, c in enumerate(COLUMNS) if c != "CPU" or any(r[i] for r in rows)]
    lines = [HEADER, "| " + " | ".join(COLUMNS[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    for r in rows:  # the CPU column only where some manifest records one
        lines.append("| " + " | ".join(r[i].replace("|", "\\|") for i in keep) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        raise SystemExit(__doc__)
    text = render()
    page = RUNS / "README.md"
    if argv == ["--check"]:
        if not page.is_file() or page.read_text() != text:
            print(f"{page} is out of date: run python scripts/runs_index.py", file=sys.stderr)
            return 1
        return 0
    page.write_text(text)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
