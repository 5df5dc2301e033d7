"""Experiment trackers through verl's own tracking helper (``verl.utils.tracking.Tracking``).

``--logger console,tensorboard,wandb,mlflow`` (names as verl's ``trainer.logger`` uses them; also
swanlab and trackio where installed) on train, sft and iterate. ``open_tracker`` points each
backend at the run: TensorBoard event files under ``RUN_DIR/tensorboard`` (unless
``TENSORBOARD_DIR`` is set), wandb files under ``RUN_DIR`` (``WANDB_DIR``) with a run id derived
from the run name and ``resume=allow``, so a resumed iterate continues the same wandb run
(``WANDB_MODE=offline`` works without an account), MLflow under ``RUN_DIR/mlruns`` unless
``MLFLOW_TRACKING_URI`` is set. Steps only grow: iterate keeps its step counter in the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from selfplay.environ import scoped_env

LOGGERS = ("console", "tensorboard", "wandb", "mlflow", "swanlab", "trackio")


def parse_loggers(text: str | None) -> tuple[str, ...]:
    """``"console,wandb"`` -> ("console", "wandb"); ValueError naming the accepted names."""
    names = tuple(dict.fromkeys(x.strip() for x in (text or "").split(",") if x.strip()))
    bad = [x for x in names if x not in LOGGERS]
    if bad:
        raise ValueError(f"unknown logger {', '.join(bad)}; choose from {', '.join(LOGGERS)}")
    return names


def run_id(name: str) -> str:
    """A stable tracker run id for a run name (the same run resumes the same tracked run)."""
    return "selfplay-" + hashlib.sha256(name.encode()).hexdigest()[:12]


@contextlib.contextmanager
def open_tracker(
    loggers: tuple[str, ...], *, project: str, name: str, run_dir: Path, config: dict[str, Any]
) -> Iterator[Any]:
    """A verl ``Tracking`` for ``loggers`` (None when there are none), finished on exit."""
    if not loggers:
        yield None
        return
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "TENSORBOARD_DIR": os.environ.get("TENSORBOARD_DIR") or str(run_dir / "tensorboard"),
        "WANDB_DIR": os.environ.get("WANDB_DIR") or str(run_dir),
        "WANDB_RUN_ID": os.environ.get("WANDB_RUN_ID") or run_id(f"{project}/{name}"),
        "WANDB_RESUME": os.environ.get("WANDB_RESUME") or "allow",
        "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI")
        or (run_dir / "mlruns").as_uri(),
    }
    from verl.utils.tracking import Tracking

    with scoped_env(env):
        tracker = Tracking(
            project_name=project,
            experiment_name=name,
            default_backend=list(loggers),
            config={"trainer": {}, "selfplay": config},
        )
        try:
            yield tracker
        finally:
            tracker.finish()


def flat(prefix: str, values: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a (nested) dict as ``prefix/key`` scalars."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat(f"{prefix}/{key}", value))
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int | float) and value == value:  # not NaN
            out[f"{prefix}/{key}"] = float(value)
    return out


def tracked(logger: str, cfg, prefix: str, run, show):
    """``run(on_step)`` of train or sft with each step shown and sent to the --logger trackers
    as ``PREFIX/*`` (their files beside the output folder, in tracking/NAME, not in it)."""
    from dataclasses import asdict

    from selfplay.errors import UserError

    try:
        loggers = parse_loggers(logger)
    except ValueError as e:
        raise UserError(f"--logger: {e}") from None
    out = Path(cfg.out).resolve()
    with open_tracker(
        loggers,
        project="selfplay",
        name=out.name,
        run_dir=out.parent / "tracking" / out.name,
        config=cfg.model_dump(mode="json"),
    ) as tracker:

        def on_step(m, total: int) -> None:
            show(m, total)
            if tracker is not None:
                tracker.log(flat(prefix, asdict(m)), step=m.step)

        return run(on_step)
