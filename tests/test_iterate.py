"""`selfplay iterate` end to end on CPU with the real verl trainer, and kill-anywhere resume.

The model is the tiny test model after a few supervised steps on 3x3 moves (``primed_model``), so
some sampled games reach agreements and GRPO groups carry a signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from selfplay.records import iter_game_records

pytestmark = pytest.mark.slow

ROUNDS = 2


def _cmd(root: Path, model: Path, name: str) -> list[str]:
    return [
        sys.executable, "-m", "selfplay", "iterate",
        "--name", name,
        "--data-root", str(root / "data"),
        "--checkpoint-root", str(root / "checkpoints"),
        "--model", str(model),
        "--iterations", str(ROUNDS),
        "--games-per-iter", "16",
        "--games-per-scenario", "4",
        "--table-size", "3",
        "--temperature", "0.5",
        "--max-new-tokens", "48",
        "--lr", "1e-4",
        "--micro-batch-size", "4",
        "--seed", "3",
        # one game at a time: every request is decoded alone, so sampling does not depend on
        # which games share a padded batch (that moves logits ~1e-6 and can flip a rare token)
        "--concurrency", "1",
        "--eval-scenarios", "3",
        "--logger", "tensorboard,wandb",
        "--keep-checkpoints", "last",
        "--no-report",
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SELFPLAY_HOLD")}
    return {**env, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline", **extra}


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _start(cmd: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        env=_env(**env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before the kill point"
        assert time.time() < deadline, "kill point never reached"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def _comparable(record, root: Path) -> tuple[dict, list[float]]:
    """A game without its timings, and its log-probs apart: they are compared with a tolerance
    because the hf engine's padded batches differ after a resume and move them by ~1e-6."""
    d = record.model_dump(mode="json", exclude={"timings"})
    for seat in d["seats"]:  # round 1 plays round 0's checkpoint, under each run's own root
        seat["name"] = seat["name"].replace(str(root), "ROOT")
    logprobs = []
    for t in d["tokens"]:
        if t is not None:
            logprobs += t.pop("logprobs")
    return d, logprobs


def _snapshot(root: Path, name: str) -> dict:
    """What must not depend on interruptions: games, rows in their order, the rounds' models
    (their weights' sha256: bit for bit)."""
    import hashlib

    run = root / "data" / name
    manifest = json.loads((run / "manifest.json").read_text())
    games, rows, logprobs, models = {}, {}, {}, {}
    for k in range(ROUNDS):
        for r in iter_game_records(run / f"round_{k}" / "games.jsonl"):
            assert r.game_id not in games, "duplicated game"
            games[r.game_id], logprobs[r.game_id] = _comparable(r, root)
        path = run / f"round_{k}" / "train.parquet"
        if path.exists():
            table = pq.read_table(path)  # in file order: the order trained in
            cols = ["game_id", "seat", "group_id", "prompt_ids", "response_ids", "reward"]
            rows[k] = table.select(cols).to_pylist()
        weights = root / "checkpoints" / name / f"round_{k}" / "model.safetensors"
        if weights.exists():
            models[k] = hashlib.sha256(weights.read_bytes()).hexdigest()
    rounds = {k: sorted(v["stages"]) for k, v in manifest["rounds"].items()}
    metrics = [orjson.loads(x) for x in (run / "metrics.jsonl").read_bytes().splitlines()]
    return {
        "games": games,
        "rows": rows,
        "rounds": rounds,
        "metric_rounds": [m["round"] for m in metrics],
        "logprobs": logprobs,
        "models": models,
    }


@pytest.fixture(scope="module")
def reference_run(primed_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("iterate_ref")
    res = _run(_cmd(root, primed_model, "ref"))
    (root / "iterate.log").write_text(res.stderr)
    return root


def test_two_rounds_round2_uses_round1_checkpoint(reference_run, primed_model):
    run = reference_run / "data" / "ref"
    manifest = json.loads((run / "manifest.json").read_text())
    ckpt0 = reference_run / "checkpoints" / "ref" / "round_0"
    assert manifest["rounds"]["0"]["model"] == str(primed_model)
    assert manifest["rounds"]["1"]["model"] == str(ckpt0)
    assert all(
        set(r["stages"]) == {"generate", "convert", "train"} for r in manifest["rounds"].values()
    )
    assert manifest["versions"]["verl"] == "0.9.1"
    # round 1's games were generated by round 0's checkpoint, whose weights moved
    games1 = list(iter_game_records(run / "round_1" / "games.jsonl"))
    assert len(games1) == 16 and {g.seats[0].name for g in games1} == {str(ckpt0)}
    before = load_file(primed_model / "model.safetensors")
    after = load_file(ckpt0 / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not (before[k] == after[k]).all() for k in before)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["games"] == 16 and 0.0 <= m["reward_mean"] <= 1.0
        assert set(m["seconds"]) == {"generate", "convert", "train"}
        assert m["train"]["steps"] >= 1 and m["train"]["tokens_per_s"] > 0
        # several optimizer updates by default (rows / --updates-per-round), not one per round
        assert m["train"]["updates"] >= 2
        assert m["heldout"]["games"] == 3 and m["heldout_after"]["games"] == 3
        assert m["heldout"]["reward_ci_low"] <= m["heldout"]["reward_mean"]
    assert metrics[1]["heldout"] == metrics[0]["heldout_after"]


def test_heldout_scenarios_are_the_same_every_round_and_never_trained_on(reference_run):
    run = reference_run / "data" / "ref"
    manifest = json.loads((run / "manifest.json").read_text())
    assert sorted(manifest["heldout"], key=int) == ["0", "1", "2"]
    evals = sorted((run / "eval").glob("after_*_rounds/games/model-model.jsonl"))
    assert len(evals) == 3
    seen = [{g.scenario_id for g in iter_game_records(path)} for path in evals]
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 3
    trained = {
        g.scenario_id
        for k in range(ROUNDS)
        for g in iter_game_records(run / f"round_{k}" / "games.jsonl")
    }
    assert not seen[0] & trained
    assert all(int(g.scenario.seed) % 2 == 1 for g in iter_game_records(evals[0]))
    assert set(manifest["baselines"]) == {
        "cooperative",
        "no-talk",
        "proposer",
        "random",
        "inquisitive",
    }


def test_training_runs_in_a_fresh_process_with_all_threads(reference_run):
    """The train stage runs in its own process: the hf engine's thread setting cannot reach it,
    and each stage's memory ends with its process (the loop's own stays flat)."""
    import torch

    from selfplay.iterate.child import isolated

    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    default, before = int(fresh.stdout), torch.get_num_threads()
    torch.set_num_threads(1)  # what the hf engine did to the whole iterate process
    try:
        threads, rss = isolated(torch.get_num_threads)
    finally:
        torch.set_num_threads(before)
    assert threads == default and rss > 0
    manifest = json.loads((reference_run / "data" / "ref" / "manifest.json").read_text())
    peaks = [r["stages"]["train"]["info"]["peak_rss_mb"] for r in manifest["rounds"].values()]
    assert all(p > 0 for p in peaks) and max(peaks) <= 1.1 * min(peaks)


def test_stage_child_runs_consecutive_stages_in_one_process_each_with_its_own_peak():
    from selfplay.iterate.child import StageChild

    with StageChild() as child:
        (pid, keep), big = child.run(_allocate, 400)
        assert keep == "1"  # the hf engine keeps its last model in a stage child
        (same, _), small = child.run(_allocate, 0)
        assert same == pid != os.getpid()
        assert big > 400 and small < big - 300  # each call's own peak, not the process's
        with pytest.raises(ZeroDivisionError):
            child.run(_divide_by_zero)
        # a failed stage ends the child: the next one starts fresh
        (fresh, _), _ = child.run(_allocate, 0)
        assert fresh != pid
    assert child._pool is None


def _allocate(mib: int) -> tuple[int, str | None]:
    from selfplay.engines import KEEP_MODEL_ENV

    block = bytearray(mib * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    return os.getpid(), os.environ.get(KEEP_MODEL_ENV)


def _divide_by_zero() -> float:
    return 1 / 0


def test_heldout_evaluation_and_the_next_generate_share_one_model_load(reference_run, primed_model):
    """The held-out evaluation of the model a round starts from and the round's generate run in
    one child, which loads the model once: round 0 (the initial model) and round 1 (round 0's
    checkpoint); the last evaluation has no generate after it."""
    log = (reference_run / "iterate.log").read_text()
    reused = [line for line in log.splitlines() if "reusing the model" in line]
    ckpt0 = reference_run / "checkpoints" / "ref" / "round_0"
    assert len(reused) == 2, log[-3000:]
    assert f"model {primed_model} loaded" in reused[0] and f"model {ckpt0} loaded" in reused[1]


def test_kill_anywhere_then_resume_matches_uninterrupted(reference_run, primed_model, tmp_path):
    cmd = _cmd(tmp_path, primed_model, "ref")
    run = tmp_path / "data" / "ref"
    # 1. SIGKILL during generate, after a few games are written
    proc = _start(cmd)
    _kill_when(proc, lambda: _lines(run / "round_0" / "games.jsonl") >= 3)
    # 2. during convert (the run holds at the start of convert until killed)
    proc = _start(cmd, SELFPLAY_HOLD_BEFORE="convert")
    _kill_when(proc, lambda: (run / "holding_convert").exists())
    (run / "holding_convert").unlink()
    # 3. during train: once the trainer has created its (hidden, partial) output folder
    proc = _start(cmd)
    _kill_when(proc, lambda: (tmp_path / "checkpoints" / "ref" / ".round_0.partial").exists())
    # 4. the same command finishes the run
    _run(cmd)
    got, want = _snapshot(tmp_path, "ref"), _snapshot(reference_run, "ref")
    got_lp, want_lp = got.pop("logprobs"), want.pop("logprobs")
    assert got["games"].keys() == want["games"].keys()
    for game_id, game in want["games"].items():  # the same tokens, actions, rewards
        differ = [k for k in game if got["games"][game_id][k] != game[k]]
        assert not differ, f"{game_id} differs in {differ}"
    assert got == want  # and the same rows and rounds
    assert got_lp.keys() == want_lp.keys()
    for game_id, lp in want_lp.items():
        np.testing.assert_allclose(got_lp[game_id], lp, atol=1e-4)


def test_warm_start_resumes_after_sigkill(primed_model, tmp_path):
    cmd = _cmd(tmp_path, primed_model, "warm")
    cmd[cmd.index("--iterations") + 1] = "1"
    cmd += ["--warm-start", "scripted:no-talk:6", "--warm-start-lr", "1e-3"]
    ws = tmp_path / "checkpoints" / "warm" / "warm_start"
    proc = _start(cmd)
    _kill_when(proc, lambda: (ws / "sft_data" / "rows.parquet").exists())
    assert not (ws / "config.json").exists()  # killed inside the stage
    _run(cmd)
    manifest = json.loads((tmp_path / "data" / "warm" / "manifest.json").read_text())
    assert manifest["warm_start"]["artifacts"]["model"] == str(ws)
    assert (
        manifest["warm_start"]["info"]["rows"] == 12
        and manifest["warm_start"]["info"]["updates"] == 3
    )
    assert manifest["rounds"]["0"]["model"] == str(ws)
    assert manifest["heldout_initial"]["games"] == 3
    assert (ws / "config.json").exists()
    before = load_file(primed_model / "model.safetensors")
    after = load_file(ws / "model.safetensors")
    assert any(not (before[k] == after[k]).all() for k in before)


def test_changed_config_is_a_clear_error_and_more_iterations_extend(reference_run, primed_model):
    cmd = _cmd(reference_run, primed_model, "ref")
    res = subprocess.run(
        [*cmd, "--lr", "1e-3"], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 1
    assert "another configuration" in res.stderr and "train" in res.stderr
    # re-running the finished command does nothing new
    before = (reference_run / "data" / "ref" / "manifest.json").read_bytes()
    _run(cmd)
    assert (reference_run / "data" / "ref" / "manifest.json").read_bytes() == before


def test_keep_checkpoints_last_then_none_on_resume(reference_run, primed_model):
    ckpts = reference_run / "checkpoints" / "ref"
    # --keep-checkpoints last: only the newest trained round keeps verl's optimizer state
    assert not (ckpts / "round_0" / "verl_checkpoint").exists()
    assert (ckpts / "round_1" / "verl_checkpoint").is_dir()
    # retention may change on resume (it is not part of the run's identity) ...
    cmd = _cmd(reference_run, primed_model, "ref")
    _run([*cmd, "--keep-checkpoints", "none"])
    assert not (ckpts / "round_1" / "verl_checkpoint").exists()
    # ... and the HF weights every round starts from stay, so the run still extends
    for k in range(ROUNDS):
        assert (ckpts / f"round_{k}" / "model.safetensors").is_file()
    manifest = json.loads((reference_run / "data" / "ref" / "manifest.json").read_text())
    assert manifest["config"]["train"]["keep_checkpoints"] == "none"


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of a wandb offline run file (a leveldb-style log of protobuf records)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf, rows = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # full / first, or middle / last
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                        for i in rec.history.item
                    }
                )
            buf = b""
    return rows


def test_trackers_get_training_steps_and_round_metrics(reference_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = reference_run / "data" / "ref"
    manifest = json.loads((run / "manifest.json").read_text())
    steps = sum(r["stages"]["train"]["info"]["steps"] for r in manifest["rounds"].values())
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("train/pg_loss", "train/grad_norm", "train/tokens_per_s", "round/reward_mean",
                "round/heldout/reward_mean", "round/agreement_rate"):  # fmt: skip
        assert tag in tags, tag
    assert len(events.Scalars("train/pg_loss")) == steps
    assert [e.value for e in events.Scalars("round/round")] == [0.0, 1.0]
    held = [e.value for e in events.Scalars("round/heldout/reward_mean")]
    assert held == pytest.approx([manifest["heldout"][k]["reward_mean"] for k in ("1", "2")])
    # one run id, however many sessions (a re-run of the finished command adds an empty one)
    files = sorted(run.glob("wandb/offline-run-*/run-selfplay-*.wandb"))
    assert files and len({f.name for f in files}) == 1
    rows = [row for f in files for row in _wandb_history(f)]
    assert [r["_step"] for r in rows] == list(range(1, steps + 3))  # steps only grow
    assert sum("round/reward_mean" in r for r in rows) == 2
    assert manifest["tracker_step"] == steps + 2


def test_changed_configuration_error_shows_a_left_out_setting_as_its_default(tmp_path):
    """A setting that a run's identity leaves out while it has its default (added later) shows as
    that default, not None: what `make demo` says when recipes/demo.toml changed under an old
    data/demo."""
    from selfplay.iterate.config import IterateConfig, IterateError
    from selfplay.iterate.resume import Run
    from selfplay.manifest import StageRecord

    old = IterateConfig(
        name="x", model="m", engine={"kind": "hf", "model": "m"}, iterations=1, games_per_iter=2,
        data_root=tmp_path, checkpoint_root=tmp_path, warm_start="scripted:cooperative:4",
        warm_start_epochs=2,
    )  # fmt: skip
    run = Run(old)
    run.manifest.warm_start = StageRecord(finished_at=0.0, seconds=1.0)  # started: no silent reset
    run.save()
    new = old.model_copy(update={"warm_start_epochs": 1, "warm_start_mini_batch_size": 2})
    with pytest.raises(IterateError) as err:
        Run(new)
    assert "warm_start_epochs: 2 -> 1 (default)" in str(err.value)
    assert "warm_start_mini_batch_size: 4 (default) -> 2" in str(err.value)
    assert "None" not in str(err.value)


def test_no_eval_initial_skips_only_the_initial_models_evaluation_and_may_change_on_resume(
    tmp_path,
):
    """`--no-eval-initial` leaves out the held-out pass over the model before the warm start (no
    child is started: `heldout_stage` returns before it), not a round's; a run resumes with it
    turned either way."""
    from selfplay.iterate.config import IterateConfig
    from selfplay.iterate.heldout import heldout_stage
    from selfplay.iterate.resume import Run

    cfg = IterateConfig(
        name="x", model="m", engine={"kind": "hf", "model": "m"}, iterations=1, games_per_iter=2,
        data_root=tmp_path, checkpoint_root=tmp_path, warm_start="scripted:cooperative:4",
        eval_scenarios=4, eval_initial=False,
    )  # fmt: skip
    run = Run(cfg)
    run.save()
    assert heldout_stage(cfg, None, "m", run.manifest) is None

    class Child:  # a round's evaluation goes on: it reaches the child
        def run(self, *args):
            raise RuntimeError("evaluated")

    with pytest.raises(RuntimeError, match="evaluated"):
        heldout_stage(cfg, 0, "m", run.manifest, Child())
    assert Run(cfg.model_copy(update={"eval_initial": True})).manifest.heldout_initial is None


def _beside_config(model: Path, root: Path, **extra):
    from selfplay.iterate.config import IterateConfig
    from selfplay.records import SamplingParams

    return IterateConfig(
        name="beside", iterations=1, model=str(model), engine={"kind": "hf", "model": str(model)},
        data_root=root / "data", checkpoint_root=root / "ckpt", table_size=3, games_per_iter=8,
        games_per_scenario=4, eval_scenarios=6, max_actions=8, seed=3,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=32), **extra,
    )  # fmt: skip


def test_heldout_games_play_beside_the_rounds_games_in_shared_batches(
    primed_model, tmp_path, monkeypatch
):
    """With ``eval_beside_generate`` (the default) the held-out evaluation of a model and the
    next round's generate play at once on one hf engine: some decoding batch holds both a greedy
    (held-out) and a sampled (training) request, every planned game of each is written, and the
    held-out result is the evaluation's own (its games file, one game per scenario)."""
    from selfplay.engines.hf import HFEngine
    from selfplay.iterate.child import _default_generate
    from selfplay.iterate.stages import _beside, _generate_configs, beside_possible

    cfg = _beside_config(primed_model, tmp_path)
    assert beside_possible(cfg, _default_generate)
    assert not beside_possible(cfg.model_copy(update={"concurrency": 1}), _default_generate)
    assert not beside_possible(
        cfg.model_copy(update={"eval_beside_generate": False}), _default_generate
    )
    steps: list[set[float]] = []  # the temperatures of each decoding step's live rows
    sample_step = HFEngine._sample_step

    def recorded(self, run):
        steps.append({run.requests[run.active[b]].temperature for b in run.live_positions()})
        return sample_step(self, run)

    monkeypatch.setattr(HFEngine, "_sample_step", recorded)
    gen_cfg, engine_cfg = _generate_configs(cfg, 0, str(primed_model))
    out = tmp_path / "eval"
    held, base = _beside(cfg, str(primed_model), out, True, gen_cfg, engine_cfg)
    assert any(t == {0.0, 1.0} for t in steps), steps
    assert held.games == 6 and held.model == str(primed_model) and held.path == str(out)
    assert set(base) >= {"cooperative", "random"} and all(b.games == 6 for b in base.values())
    assert _lines(out / "games" / "model-model.jsonl") == 6
    ids = [r.game_id for r in iter_game_records(gen_cfg.games_path)]
    assert len(ids) == len(set(ids)) == 8


def test_heldout_beside_generate_resumes_after_sigkill_without_lost_or_duplicated_games(
    primed_model, tmp_path
):
    """A two-round run whose held-out evaluations play beside its generate (no --concurrency 1:
    games in flight together): every model but the last is evaluated beside the next round's
    games, round 0's model beside round 1's too, not alone after round 0's training. Killed
    while round 1's games are being written, it resumes: every planned game once, the held-out
    result of round 0's model recorded with the games played beside it, the last model's
    evaluation after, and each round's tracker line with the held-out result of its model."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cmd = _cmd(tmp_path, primed_model, "beside")
    i = cmd.index("--concurrency")
    del cmd[i : i + 2]
    run = tmp_path / "data" / "beside"
    proc = _start(cmd)
    _kill_when(proc, lambda: _lines(run / "round_1" / "games.jsonl") >= 3)
    manifest = json.loads((run / "manifest.json").read_text())
    assert "0" in manifest["heldout"] and "train" in manifest["rounds"]["0"]["stages"]
    assert "1" not in manifest["heldout"]  # killed inside the shared stage: neither counted
    _run(cmd)
    manifest = json.loads((run / "manifest.json").read_text())
    for k in range(ROUNDS):
        generate = manifest["rounds"][str(k)]["stages"]["generate"]
        assert generate["info"]["with_heldout"] is True
        ids = [r.game_id for r in iter_game_records(run / f"round_{k}" / "games.jsonl")]
        assert len(ids) == len(set(ids)) == 16
    assert [manifest["heldout"][str(k)]["games"] for k in range(ROUNDS + 1)] == [3, 3, 3]
    for k in range(ROUNDS + 1):
        assert _lines(run / "eval" / f"after_{k}_rounds" / "games" / "model-model.jsonl") == 3
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    held = [e.value for e in events.Scalars("round/heldout/reward_mean")]
    assert held == pytest.approx([manifest["heldout"][k]["reward_mean"] for k in ("1", "2")])
    assert [e.value for e in events.Scalars("round/round")] == [0.0, 1.0]


def test_a_failed_games_write_beside_the_heldout_evaluation_stops_the_run_with_its_own_error(
    primed_model, tmp_path
):
    """A file-size limit (as a full disk would) that round 0's games cross while the held-out
    games play beside them: the run stops with generate's one line naming the file and the free
    space, exit 1, as a generate alone does (not an exception group of the two), keeping the
    games written before."""
    import resource

    cmd = _cmd(tmp_path, primed_model, "full")
    i = cmd.index("--concurrency")
    del cmd[i : i + 2]
    cmd[cmd.index("--iterations") + 1] = "1"

    def limited() -> None:  # a game record is ~10 KB: the held-out file (3 games) fits
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    res = subprocess.run(
        cmd, env=_env(), capture_output=True, text=True, timeout=900, preexec_fn=limited
    )
    err = res.stderr
    assert res.returncode == 1, err[-3000:]
    assert "games.jsonl failed (File too large)" in err and "MiB are free there" in err, err[-3000:]
    assert "Traceback" not in err and "ExceptionGroup" not in err, err[-3000:]
    kept = _lines(tmp_path / "data" / "full" / "round_0" / "games.jsonl")
    assert 0 < kept < 16


def test_a_model_a_skipped_round_handed_on_keeps_its_heldout_result(tmp_path):
    """The model after round 1 that round 0 handed on unchanged (a skipped round) is not played
    again: `heldout_stage` returns round 0's result and `heldout_due` has nothing to play; another
    model after round 1 is evaluated (it reaches the child)."""
    from selfplay.iterate.config import IterateConfig
    from selfplay.iterate.heldout import heldout_due, heldout_stage
    from selfplay.iterate.resume import Run
    from selfplay.metrics import HeldOut

    cfg = IterateConfig(
        name="x", model="m", engine={"kind": "hf", "model": "m"}, iterations=2, games_per_iter=2,
        data_root=tmp_path, checkpoint_root=tmp_path, eval_scenarios=4,
    )  # fmt: skip
    run = Run(cfg)
    none = dict.fromkeys(
        ("reward_mean", "reward_ci_low", "reward_ci_high", "agreement_rate", "mean_actions",
         "invalid_action_rate", "questions_per_game", "direct_questions_per_game",
         "general_questions_per_game"),
    )  # fmt: skip
    before = HeldOut(model="m", path="p", games=4, **{**none, "reward_mean": 0.5})
    run.manifest.heldout[0] = before

    class Child:
        def run(self, *args):
            raise RuntimeError("evaluated")

    assert heldout_due(cfg, 1, "m", run.manifest) is None
    assert heldout_stage(cfg, 1, "m", run.manifest, Child()) == (before, {})
    assert heldout_due(cfg, 1, "n", run.manifest) == tmp_path / "x" / "eval" / "after_1_rounds"
    with pytest.raises(RuntimeError, match="evaluated"):
        heldout_stage(cfg, 1, "n", run.manifest, Child())
