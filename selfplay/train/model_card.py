"""Model cards: every checkpoint directory says what it is (README.md with YAML metadata).

The card is a Hugging Face model card: YAML front matter the Hub reads (``base_model``,
``library_name``, ``tags``) plus a ``selfplay`` block with where the model came from (base model,
algorithm, round, training data, settings, the selfplay version and git commit) and, once
evaluated, its held-out results. ``write_card`` writes it after training, ``add_heldout`` adds an
evaluation, ``read_card`` returns the ``selfplay`` block (``selfplay eval`` prints it).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from selfplay.fileio import atomic_write

CARD = "README.md"


def git_commit() -> str | None:
    """The commit of the selfplay checkout this runs from (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _body(meta: dict[str, Any]) -> str:
    info = meta["selfplay"]
    lines = [
        f"# {info.get('name') or 'selfplay model'}",
        "",
        f"Trained by selfplay ({info['algorithm']}) from "
        f"`{meta.get('base_model')}` on the DialOp paper-reviewer matching game.",
        "",
        f"- training data: `{info['data'].get('path')}` ({info['data'].get('rows')} rows"
        + (
            f", {info['data']['groups_with_signal']} GRPO groups with signal"
            if info["data"].get("groups_with_signal") is not None
            else ""
        )
        + ")",
        f"- settings: {', '.join(f'{k}={v}' for k, v in info['settings'].items())}",
        f"- selfplay {info['version']}, commit {info.get('git_commit')}",
    ]

    def f(x) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    for h in info.get("heldout", []):
        lines.append(
            f"- held-out ({h['scenarios']} {h['table_size']}x{h['table_size']} scenarios, greedy"
            f", eval seed {h['eval_seed']}): reward {f(h['reward_mean'])} "
            f"[{f(h['reward_ci_low'])}, {f(h['reward_ci_high'])}], agreement "
            f"{f(h['agreement_rate'])}"
        )
    return "\n".join(lines) + "\n"


def _write(model_dir: Path, meta: dict[str, Any]) -> Path:
    path = Path(model_dir) / CARD
    text = "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + _body(meta)
    return atomic_write(path, text)


def write_card(
    model_dir: Path,
    *,
    base_model: str,
    algorithm: str,
    data: dict[str, Any],
    settings: dict[str, Any],
    name: str | None = None,
    round: int | None = None,
) -> Path:
    """Write MODEL_DIR/README.md for a model just trained."""
    from selfplay import __version__

    meta = {
        "base_model": base_model,
        "library_name": "transformers",
        "tags": ["selfplay", "dialop", algorithm],
        "selfplay": {
            "name": name,
            "algorithm": algorithm,
            "round": round,
            "data": data,
            "settings": settings,
            "version": __version__,
            "git_commit": git_commit(),
            "heldout": [],
        },
    }
    return _write(model_dir, meta)


def read_card(model_dir: str | Path) -> dict[str, Any] | None:
    """The card's metadata (front matter) of a model directory, or None without a card."""
    path = Path(model_dir) / CARD
    if not path.is_file():
        return None
    text = path.read_text()
    if not text.startswith("---\n"):
        return None
    try:
        meta = yaml.safe_load(text[4 : text.index("\n---\n", 4)])
    except (ValueError, yaml.YAMLError):
        return None
    return meta if isinstance(meta, dict) and "selfplay" in meta else None


def add_heldout(model_dir: str | Path, result: dict[str, Any]) -> bool:
    """Add a held-out evaluation to a model's card (False when it has no selfplay card)."""
    meta = read_card(model_dir)
    if meta is None:
        return False
    held = [h for h in meta["selfplay"].get("heldout", []) if h != result]
    meta["selfplay"]["heldout"] = [*held, result]
    _write(Path(model_dir), meta)
    return True


def annotate(model_dir: str | Path, **fields: Any) -> bool:
    """Set fields of the card's selfplay block (e.g. the run name and round)."""
    meta = read_card(model_dir)
    if meta is None:
        return False
    meta["selfplay"].update(fields)
    _write(Path(model_dir), meta)
    return True


def provenance(model_dir: str | Path) -> str | None:
    """One line on where a checkpoint came from, from its card (None without one)."""
    meta = read_card(model_dir)
    if meta is None:
        return None
    info = meta["selfplay"]
    where = f"round {info['round']} of {info['name']}" if info.get("round") is not None else ""
    return (
        f"{info['algorithm']} from {meta.get('base_model')}"
        + (f", {where}" if where else "")
        + f", on {info['data'].get('rows')} rows of {info['data'].get('path')}"
        + f" (selfplay {info['version']}, commit {str(info.get('git_commit'))[:10]})"
    )
