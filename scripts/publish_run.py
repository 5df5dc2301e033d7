"""Copy a finished run's report into docs/runs/NAME: REPORT.md, its plots, metrics.jsonl, the
manifest, and the held-out games of the warm-started model and of the final model (gzip), so that
anyone can recompute the claims without re-running; with the run's recipe, a RECIPE note naming
it (and what, if anything, today's recipe sets otherwise than the run had).

    python scripts/publish_run.py data/ask docs/runs/ask [recipes/ask.toml]
    python scripts/publish_run.py data/ask-cap2 docs/runs/ask-cap2 recipes/ask-cap2.toml
    python scripts/publish_run.py --notes   # each docs/runs/NAME with a recipes/NAME.toml

A run played on the test split (``iterate --test-scenarios``) also gets ``test/ROW.jsonl.gz``
for each of its test rows (warm_start or initial, final, every baseline, proposer included); a
multi-seed run (``iterate --seeds``: data/NAME/seed-K) is published seed by seed into
``seed-K/`` beside its SEEDS.md and seeds.json.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path


def _on_disk(path: str, run_dir: Path) -> Path:
    """A path a manifest holds: absolute, or relative to where iterate ran (the current folder,
    or a folder above the run's)."""
    p = Path(path)
    if p.is_absolute():
        return p
    for base in (Path.cwd(), *run_dir.resolve().parents):
        if (base / p).exists():
            return base / p
    return p


def _gzip(games: Path, out: Path) -> Path:
    """``games`` gzipped to ``out`` (mtime 0: the same games give the same bytes each time)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        games.open("rb") as src,
        out.open("wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as dst,
    ):
        shutil.copyfileobj(src, dst)
    return out


def publish_test(run_dir: Path, dest: Path, manifest: dict) -> list[Path]:
    """The test split's games of every row (``Manifest.test``) as dest/test/ROW.jsonl.gz."""
    from selfplay.iterate.test_split import games_file

    written = []
    for row, held in (manifest.get("test") or {}).items():
        games = games_file(_on_disk(held["path"], run_dir), row)
        written.append(_gzip(games, dest / "test" / f"{row}.jsonl.gz"))
    return written


def publish_seeds(parent: Path, dest: Path) -> list[Path]:
    """A multi-seed run: each data/NAME/seed-K into dest/seed-K, then SEEDS.md and seeds.json."""
    written = []
    for seed_dir in sorted(parent.glob("seed-*")):
        if (seed_dir / "manifest.json").is_file():
            written += publish(seed_dir, dest / seed_dir.name)
    for name in ("SEEDS.md", "seeds.json"):
        if (parent / name).is_file():
            shutil.copyfile(parent / name, dest / name)
            written.append(dest / name)
    return written


def publish(run_dir: Path, dest: Path) -> list[Path]:
    if not (run_dir / "manifest.json").is_file() and any(run_dir.glob("seed-*/manifest.json")):
        return publish_seeds(run_dir, dest)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    held = {int(k): v for k, v in manifest.get("heldout", {}).items()}
    if 0 not in held or len(held) < 2:
        raise SystemExit(f"{run_dir}: no held-out results after 0 and after the last round")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("REPORT.md", "metrics.jsonl", "manifest.json", *_plots(run_dir)):
        shutil.copyfile(run_dir / name, dest / name)
        written.append(dest / name)
    heldout = dest / "heldout"
    heldout.mkdir(exist_ok=True)
    for label, k in (("warm_start", 0), ("final", max(held))):
        games = _on_disk(held[k]["path"], run_dir) / "games" / "model-model.jsonl"
        written.append(_gzip(games, heldout / f"{label}.jsonl.gz"))
    return written + publish_test(run_dir, dest, manifest)


def recipe_note(recipe: Path, manifest: Path) -> str:
    """docs/runs/NAME/RECIPE: the recipe of the run, and whether it gives the run's config (what
    a resume compares, ``IterateConfig.identity``) or which options it sets otherwise."""
    from selfplay.cli import parse_iterate

    ours = parse_iterate(["--config", str(recipe)], resolve=False).identity()
    theirs = parse_iterate(["--config", str(manifest)], resolve=False).identity()
    lines = [f"recipe: {recipe.as_posix()}"]
    one_seed = manifest.parent.name.startswith("seed-")
    if one_seed:
        # One seed of a multi-seed run: it lives in data/NAME/seed-K (checkpoints likewise) under
        # its own name and seed; the recipe names the whole run.
        for key in ("name", "data_root", "checkpoint_root", "seed", "seeds"):
            ours.pop(key, None)
            theirs.pop(key, None)
    changed = _changed(theirs, ours)
    if changed:
        changes = "; ".join(changed)
        lines.append(f"today's recipe differs from this run in: {changes} (run -> recipe)")
    else:
        lines.append("it gives this run's config (the options a resume compares)")
    again = recipe if one_seed else manifest
    lines.append(f"this run again: selfplay iterate --config {again.as_posix()}")
    return "\n".join(lines) + "\n"


def _changed(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Each option whose value differs; one an identity leaves out has the value it then stands
    for (runs before the option existed had it)."""
    from selfplay.iterate.config import ADDED_LATER, TRAIN_ADDED_LATER

    implied = TRAIN_ADDED_LATER if prefix == "train." else ADDED_LATER
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = (d.get(key, implied.get(key, "(default)")) for d in (old, new))
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a} -> {b}")
    return out


def run_manifest(dest: Path) -> Path:
    """The manifest a RECIPE note compares: the run's, or for a multi-seed run its first seed's
    (the seeds' configs differ only in ``seed``)."""
    seeds = sorted(dest.glob("seed-*/manifest.json"))
    return dest / "manifest.json" if (dest / "manifest.json").is_file() or not seeds else seeds[0]


def write_notes(runs: Path = Path("docs/runs"), recipes: Path = Path("recipes")) -> list[Path]:
    written = []
    for recipe in sorted(recipes.glob("*.toml")):
        manifest = run_manifest(runs / recipe.stem)
        if manifest.is_file():
            (runs / recipe.stem / "RECIPE").write_text(recipe_note(recipe, manifest))
            written.append(runs / recipe.stem / "RECIPE")
    return written


def _plots(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("*.png"))


if __name__ == "__main__":
    if sys.argv[1:] == ["--notes"]:
        written = write_notes()
    elif len(sys.argv) in (3, 4):
        written = publish(Path(sys.argv[1]), Path(sys.argv[2]))
        if len(sys.argv) == 4:
            note = Path(sys.argv[2]) / "RECIPE"
            note.write_text(recipe_note(Path(sys.argv[3]), run_manifest(Path(sys.argv[2]))))
            written.append(note)
    else:
        raise SystemExit(__doc__)
    for path in written:
        print(path)
