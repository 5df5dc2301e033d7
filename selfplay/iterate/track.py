"""A round's metrics (metrics.jsonl) and what the experiment trackers are sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from selfplay.iterate.child import resident_mb
from selfplay.iterate.resume import Run
from selfplay.manifest import RoundRecord, RoundStats
from selfplay.metrics import summarize
from selfplay.records import iter_game_records

ROUND_KEYS = (
    "games",
    "reward_mean",
    "reward_ci_low",
    "reward_ci_high",
    "agreement_rate",
    "invalid_action_rate",
    "mean_actions",
    "questions_per_game",
    "direct_questions_per_game",
    "general_questions_per_game",
)


HELDOUT_KEYS = (
    "reward_mean",
    "reward_ci_low",
    "reward_ci_high",
    "agreement_rate",
    "invalid_action_rate",
    "questions_per_game",
    "direct_questions_per_game",
)


def track_round(run: Run, tracker: Any, k: int) -> None:
    """Send round ``k`` (its training steps, then its metrics) to the trackers, once."""
    from selfplay.tracking import flat

    rnd = run.manifest.rounds[k]
    if rnd.tracked or rnd.metrics is None:
        return
    metrics_path = rnd.stages["train"].artifacts.get("metrics")
    if metrics_path and Path(metrics_path).exists():
        for step in orjson.loads(Path(metrics_path).read_bytes())["steps"]:
            run.manifest.tracker_step += 1
            tracker.log(flat("train", {**step, "round": k}), step=run.manifest.tracker_step)
    m = rnd.metrics
    values = {key: getattr(m, key) for key in ROUND_KEYS}
    for key, j in (("heldout_before", k), ("heldout", k + 1)):  # the round's start and result
        if (h := run.manifest.heldout.get(j)) is not None:
            values[key] = h.model_dump(include=set(HELDOUT_KEYS))
    values["trained"] = 0.0 if m.skip_reason else 1.0
    run.manifest.tracker_step += 1
    tracker.log(flat("round", {**values, "round": k}), step=run.manifest.tracker_step)
    rnd.tracked = True
    run.save()


def round_metrics(rnd: RoundRecord, games: Path) -> RoundStats:
    """The metrics.jsonl line of a finished round (without the held-out results, which
    ``Run.write_metrics`` adds): game statistics, training, stage times."""
    summary = summarize(iter_game_records(games))
    train, convert = rnd.stages["train"], rnd.stages["convert"]
    return RoundStats(
        **summary.model_dump(exclude={"partner"}),
        model=rnd.model,
        train=train.info if train.info.model_dump() else None,
        # rows, groups; expert iteration: games kept; --guide: guide games and their reward
        convert=convert.info if convert.info.model_dump() else None,
        skip_reason=train.skip_reason,
        seconds={name: rec.seconds for name, rec in rnd.stages.items()},
        # resident memory (MiB): the loop's own now, and each stage's peak (its own process)
        rss_mb={
            "loop": resident_mb(),
            **{
                n: r.info.peak_rss_mb
                for n, r in rnd.stages.items()
                if "peak_rss_mb" in r.info.model_fields_set
            },
        },
    )


def track_finished(run: Run, tracker: Any) -> None:
    """Send every round not sent yet whose result is in: its metrics, and the held-out result of
    the model it produced when the run evaluates its models (its tracker line carries both)."""
    for k, rnd in sorted(run.manifest.rounds.items()):
        if rnd.metrics is None or (run.config.eval_scenarios and k + 1 not in run.manifest.heldout):
            break  # rounds are sent in order: a later one waits for this one
        track_round(run, tracker, k)


def summary_line(run, cfg) -> str:
    """One line on a finished run: rounds trained or skipped, held-out reward before and after."""
    rounds = run.manifest.rounds.values()
    skipped = [r.stages["train"].skip_reason for r in rounds if r.stages["train"].skip_reason]
    held = run.manifest.heldout
    line = f"run {cfg.name}: {cfg.iterations} round(s), {cfg.iterations - len(skipped)} trained"
    if skipped:
        line += f", {len(skipped)} skipped ({'; '.join(sorted(set(skipped)))})"
    if held:
        first, last = held[min(held)], held[max(held)]
        initial = run.manifest.heldout_initial
        line += "; held-out reward " + (
            f"{initial.reward_mean:.3f} before the warm start, " if initial else ""
        )
        line += (
            f"{first.reward_mean:.3f} at round 0, {last.reward_mean:.3f} "
            f"[{last.reward_ci_low:.3f}, {last.reward_ci_high:.3f}] after {max(held)}"
        )
    return line
