"""Copy a finished run's report into docs/runs/NAME: REPORT.md, its plots, metrics.jsonl, the
manifest, and the held-out games of the warm-started model and of the final model (gzip), so that
anyone can recompute the claims without re-running.

    python scripts/publish_run.py data/ask docs/runs/ask
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path


def publish(run_dir: Path, dest: Path) -> list[Path]:
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
        games = Path(held[k]["path"]) / "games" / "model-model.jsonl"
        if not games.is_absolute():
            games = run_dir.parent.parent / games  # paths are relative to where iterate ran
        out = heldout / f"{label}.jsonl.gz"
        # mtime 0: the same games give the same bytes each time
        with (
            games.open("rb") as src,
            out.open("wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as dst,
        ):
            shutil.copyfileobj(src, dst)
        written.append(out)
    return written


def _plots(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("*.png"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    for path in publish(Path(sys.argv[1]), Path(sys.argv[2])):
        print(path)
