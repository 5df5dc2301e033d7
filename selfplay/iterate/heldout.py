"""The two stages outside a round: the warm start and the held-out evaluation (placed in the run's
table before the warm start, before each round and after the last; ``loop.table``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from selfplay.generate.config import PlayOptions
from selfplay.iterate.child import StageChild, hold_if_asked, isolated
from selfplay.iterate.config import IterateConfig, IterateError
from selfplay.manifest import HeldoutInfo, Manifest, StageRecord, WarmStartInfo
from selfplay.metrics import HeldOut
from selfplay.players.partners import PartnerOptions, stored_partner
from selfplay.records import SamplingParams

log = logging.getLogger(__name__)


def warm_start_config(cfg: IterateConfig):
    """The ``selfplay sft`` config of the run's warm start (``scripted:NAME:GAMES[,...]``)."""
    from selfplay.iterate.warm_start import SFTConfig

    assert cfg.warm_start is not None  # its form was checked by the config
    against = {}
    if cfg.warm_start_partner == "run":  # the teacher in the model's seat, the run's partner
        partner = cfg.partner  # a ScriptedPartner: checked by the config
        against = {"partner": f"scripted:{partner.name}", "clone": str(cfg.policy_seat)}
    return SFTConfig(
        model=cfg.model,
        out=cfg.warm_start_dir,
        teacher=cfg.warm_start,
        **against,
        lr=cfg.warm_start_lr,
        epochs=cfg.warm_start_epochs,
        mini_batch_size=cfg.warm_start_mini_batch_size,
        **cfg.model_dump(include={"game", "table_size", "max_actions", "seed", "max_length"}),
        **cfg.train.model_dump(include={"dtype", "micro_batch_size", "gpus", "ray_address"}),
    )


def _warm_start_sft(cfg: IterateConfig) -> WarmStartInfo:
    """The warm-start stage's work (in a child): behaviour cloning of the scripted teacher."""
    from selfplay.iterate.warm_start import sft

    result = sft(warm_start_config(cfg))
    losses = [s.loss for s in result.steps]
    return WarmStartInfo(
        rows=result.rows,
        rows_by_source=result.sources,
        updates=result.steps[-1].step if result.steps else 0,
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        tokens_per_s=float(np.mean([s.tokens_per_s for s in result.steps])),
    )


def warm_start_stage(cfg: IterateConfig) -> StageRecord:
    """The warm start (before round 0): a model given as is, or behaviour cloning of a scripted
    teacher (``scripted:NAME:GAMES``) in a child process."""
    assert cfg.warm_start is not None
    started = time.time()
    if not cfg.warm_start.startswith("scripted:"):
        return StageRecord.since(started, artifacts={"model": cfg.warm_start}, info=WarmStartInfo())
    out = cfg.warm_start_dir  # the loop cleared the way (Run.claim: its own leftovers only)
    hold_if_asked(cfg.run_dir, "warm_start")
    log.info("warm start: behaviour cloning %s into %s", cfg.warm_start, out)
    info, rss = isolated(_warm_start_sft, cfg)
    from selfplay.train.model_card import annotate

    annotate(out, name=f"{cfg.name} (warm start)")
    info = info.model_copy(update={"peak_rss_mb": rss})
    return StageRecord.since(started, artifacts={"model": str(out)}, info=info)


def eval_config(
    cfg: IterateConfig,
    models: dict[str, str],
    out: Path,
    baselines: bool,
    *,
    num_scenarios: int,
    split: str = "dev",
):
    """The ``selfplay eval`` config of ``models``' (label -> model) held-out games: greedy, on
    ``num_scenarios`` scenarios of the run's ``split`` and on its engine (hf on its device and
    dtype, or a server: an attached server loads the evaluated weights with load_weights, as
    the next round would), with the scripted baselines on the same scenarios when asked."""
    from selfplay.evaluate.config import EvalConfig, ModelSpec

    return EvalConfig(
        models=tuple(ModelSpec(label=label, model=m) for label, m in models.items()),
        num_scenarios=num_scenarios,
        seed=cfg.eval_seed,
        split=split,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens),
        baselines=cfg.game.heldout_baselines if baselines else (),
        engine=cfg.engine,
        out=out,
        **cfg.model_dump(include=set(PlayOptions.model_fields) | set(PartnerOptions.model_fields)),
    )


async def heldout_eval_async(
    cfg: IterateConfig, model: str, out: Path, baselines: bool, engine=None
) -> tuple[HeldOut, dict[str, HeldOut]]:
    """``model``'s held-out result and the baselines' (when asked); on ``engine`` when given (one
    the caller started and closes, see ``stages.generate_beside_heldout``)."""
    from selfplay.evaluate.run import run_eval_async

    config = eval_config(cfg, {"model": model}, out, baselines, num_scenarios=cfg.eval_scenarios)
    result = await run_eval_async(config, engine=engine)
    row = result.row("model", "model")
    if row.error:
        raise IterateError(f"held-out evaluation of {model} failed: {row.error}")
    baseline_rows = {r.name: held_out(r, out) for r in result.rows if r.kind == "baseline"}
    return held_out(row, out), baseline_rows


def held_out(row, out: Path) -> HeldOut:
    """An evaluation row (a model's or a baseline's) as the manifest keeps it."""
    fields = set(HeldOut.model_fields) - {"model", "path"}
    return HeldOut(model=row.model or row.name, path=str(out), **row.model_dump(include=fields))


def _heldout_eval(
    cfg: IterateConfig, model: str, out: Path, baselines: bool
) -> tuple[HeldOut, dict[str, HeldOut]]:
    """Greedy games of ``model`` on the run's held-out scenarios (in a child), and the scripted
    baselines on the same scenarios when asked."""
    import asyncio

    return asyncio.run(heldout_eval_async(cfg, model, out, baselines))


def _carried(k: int | None, model: str, held: dict[int, HeldOut]) -> bool:
    """Whether the model after ``k`` rounds is the one after ``k - 1`` (a skipped round handed it
    on unchanged), already evaluated."""
    return bool(k) and (k - 1) in held and held[k - 1].model == model


def heldout_due(cfg: IterateConfig, k: int | None, model: str, manifest: Manifest) -> Path | None:
    """Where the held-out evaluation of ``model`` after ``k`` rounds (None: the initial model)
    goes when it has to be played now; None when nothing is to play (no held-out scenarios, the
    initial model with ``eval_initial`` off, already evaluated, or carried forward unchanged by a
    skipped round: ``heldout_stage`` records that one)."""
    held = manifest.heldout
    if cfg.eval_scenarios == 0 or (k is None and not cfg.eval_initial):
        return None
    if k in held if k is not None else manifest.heldout_initial:
        return None
    if _carried(k, model, held):
        return None
    return cfg.run_dir / "eval" / ("initial" if k is None else f"after_{k}_rounds")


def heldout_recorded(cfg: IterateConfig, k: int | None, model: str, result: HeldOut) -> None:
    """After a held-out evaluation after ``k`` rounds: its line in ``model``'s card and the log."""
    if k is None:
        return
    from selfplay.train.model_card import add_heldout

    add_heldout(
        model,
        {
            "scenarios": cfg.eval_scenarios,
            "table_size": cfg.table_size,
            "eval_seed": cfg.eval_seed,
            "partner": stored_partner(cfg.partner),
            **result.model_dump(
                include={"reward_mean", "reward_ci_low", "reward_ci_high", "agreement_rate"}
            ),
        },
    )
    log.info(
        "held-out after %d round(s): reward %.3f [%.3f, %.3f], agreement %.2f",
        k,
        result.reward_mean or 0.0,
        result.reward_ci_low or 0.0,
        result.reward_ci_high or 0.0,
        result.agreement_rate or 0.0,
    )


def heldout_stage(
    cfg: IterateConfig,
    k: int | None,
    model: str,
    manifest: Manifest,
    child: StageChild | None = None,
) -> StageRecord | None:
    """The held-out stage of ``model`` after ``k`` rounds (None: the initial model, before the
    warm start): its result and the baselines when the run has none yet (``HeldoutInfo``); None
    when there is nothing to do (no held-out scenarios, the initial model with ``eval_initial``
    off, or already evaluated). A model that a skipped round carried forward keeps its result
    (``carried``). Runs in ``child`` when given (the loop's child, kept for the next round's
    generate with the same model), else in a child of its own."""
    started = time.time()
    held = manifest.heldout
    if cfg.eval_scenarios and k not in held and _carried(k, model, held):
        return StageRecord.since(started, info=HeldoutInfo(result=held[k - 1], carried=True))
    out = heldout_due(cfg, k, model, manifest)
    if out is None:
        return None
    log.info("held-out evaluation of %s on %d scenarios", model, cfg.eval_scenarios)
    args = (_heldout_eval, cfg, model, out, not manifest.baselines)
    (result, base), rss = child.run(*args) if child is not None else isolated(*args)
    heldout_recorded(cfg, k, model, result)
    info = HeldoutInfo(result=result, baselines=base, peak_rss_mb=rss)
    return StageRecord.since(started, info=info)
