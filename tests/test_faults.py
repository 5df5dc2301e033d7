"""Faults a user meets, each a real subprocess on the tiny primed model, killed the way a user's
run would be. The fault table (docs/guide/faults.md) names these tests.

- generate: games.jsonl ends in plan order whatever order the games finished in, so a resumed
  run writes the same file (rows, model) as an uninterrupted one; a write that fails (a full disk,
  a file-size limit) stops generate at once, keeping the games written before.
- The iterate process alone killed (SIGKILL, as by the OOM killer or a closed terminal) or
  stopped (SIGTERM, as by a scheduler) during generate: no stage process outlives it by more
  than 30 s, and the same command then runs to the end (nothing holds the run's lock).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.fakes import iterate_cmd as _cmd
from tests.fakes import line_count as _lines
from tests.fakes import run_ok as _run
from tests.fakes import subprocess_env as _env

pytestmark = pytest.mark.slow

SURVIVAL_S = 30  # what the README promises: no stage process outlives the loop by longer


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_no_stage_outlives_the_iterate_process(primed_model, tmp_path, sig):
    cmd = _cmd(tmp_path, primed_model, "orphan")
    cmd[cmd.index("--iterations") + 1] = "1"
    cmd[cmd.index("--games-per-iter") + 1] = "48"  # generate outlasts the kill by far
    games = tmp_path / "data" / "orphan" / "round_0" / "games.jsonl"
    proc = subprocess.Popen(
        cmd,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # the signal goes to the parent alone, never to its group
    )
    deadline = time.time() + 600
    while _lines(games) < 2:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "generate never wrote a game"
        time.sleep(0.2)
    stage = _descendants(proc.pid)
    assert stage, "generate runs in a child process"
    os.kill(proc.pid, sig)  # the parent alone
    stderr = proc.communicate(timeout=120)[1].decode()
    if sig == signal.SIGTERM:
        assert proc.returncode == 130 and "interrupted" in stderr, stderr[-3000:]
    stopped = time.time()
    while any(_alive(p) for p in stage) and time.time() - stopped < SURVIVAL_S + 5:
        time.sleep(0.5)
    survivors = [p for p in stage if _alive(p)]
    for p in survivors:  # leave nothing behind, whatever the outcome
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"stage processes outlived the iterate process: {survivors}"
    assert time.time() - stopped < SURVIVAL_S
    kept = _lines(games)
    assert 2 <= kept < 48
    _run(cmd)  # the same command resumes and finishes: nothing holds the run's lock
    assert _lines(games) == 48


# --- generate: the file does not depend on when games finished; a failed write stops at once --


def _generate_cmd(out: Path, model: Path, games: int, concurrency: int) -> list[str]:
    return [
        sys.executable, "-m", "selfplay", "generate", "--out", str(out), "--model", str(model),
        "--num-games", str(games), "--games-per-scenario", "4", "--concurrency", str(concurrency),
        "--table-size", "3", "--max-new-tokens", "24", "--max-actions", "6", "--seed", "1",
        "--temperature", "1.0",
    ]  # fmt: skip


def _ids(path: Path) -> list[str]:
    return [orjson.loads(line)["game_id"] for line in path.read_bytes().splitlines()]


def _plan_ids(out: Path, model: Path, games: int) -> list[str]:
    from selfplay.generate.config import GenerateConfig
    from selfplay.generate.output import plan_games

    cfg = GenerateConfig(out=out, num_games=games, model=str(model), seed=1, table_size=3)
    return [spec.game_id for spec in plan_games(cfg)]


def test_games_are_kept_in_plan_order_whatever_order_they_finished_in(tiny_model, tmp_path):
    """Eight games at a time finish in any order; the file ends in plan order, and a resumed
    run (the kept games' lines first in another order, one game missing) ends byte for byte
    the same but for the game played again."""
    out = tmp_path / "a"
    res = subprocess.run(_generate_cmd(out, tiny_model, 16, 8), env=_env(), capture_output=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    games = out / "games.jsonl"
    plan = _plan_ids(out, tiny_model, 16)
    assert _ids(games) == plan
    lines = games.read_bytes().splitlines(keepends=True)
    resumed = tmp_path / "b"
    resumed.mkdir()
    (resumed / "generate.json").write_bytes((out / "generate.json").read_bytes())
    (resumed / "games.jsonl").write_bytes(b"".join(reversed(lines[:5] + lines[6:])))
    cmd = _generate_cmd(resumed, tiny_model, 16, 8)
    res = subprocess.run(cmd, env=_env(), capture_output=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    again = (resumed / "games.jsonl").read_bytes().splitlines(keepends=True)
    assert _ids(resumed / "games.jsonl") == plan
    assert again[:5] + again[6:] == lines[:5] + lines[6:]


def test_a_failed_write_stops_generate_at_once(tiny_model, tmp_path):
    """A file-size limit at a tenth of the games file (as a full disk would): the write fails,
    generate stops within a wave of games with one line naming the file and the free space, and
    the games written before are kept."""
    import resource

    full = tmp_path / "full"
    start = time.perf_counter()
    res = subprocess.run(_generate_cmd(full, tiny_model, 400, 8), env=_env(), capture_output=True)
    whole = time.perf_counter() - start
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    limit = (full / "games.jsonl").stat().st_size // 10

    def limited() -> None:  # in the child, before it runs generate
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "limited"
    start = time.perf_counter()
    res = subprocess.run(
        _generate_cmd(out, tiny_model, 400, 8), env=_env(), capture_output=True, preexec_fn=limited
    )
    stopped = time.perf_counter() - start
    err = res.stderr.decode()
    assert res.returncode == 1, err[-3000:]
    assert "games.jsonl failed (File too large)" in err and "MiB are free there" in err, err
    assert "Traceback" not in err
    kept = [line for line in (out / "games.jsonl").read_bytes().splitlines() if line.strip()]
    assert 0 < len(kept) <= 400 // 10 + 8  # a tenth of the file, give or take a wave
    assert f"{len(kept)} finished games are kept" in err or f"{len(kept) - 1} finished" in err
    assert stopped < 0.6 * whole, (stopped, whole)


# --- typos and foreign lines: one clear line at once, nothing recorded ------------------------


def test_an_engine_url_that_no_server_speaks_fails_at_once(tmp_path):
    from typer.testing import CliRunner

    from selfplay.cli import app

    for url in ("ftp://host:1", "notaurl", "http://host:port"):
        start = time.perf_counter()
        res = CliRunner().invoke(
            app,
            ["generate", "--engine", "sglang", "--engine-url", url, "--model", "m",
             "--out", str(tmp_path / "out"), "--num-games", "1"],
        )  # fmt: skip
        assert res.exit_code == 1 and "--engine-url" in res.output and url in res.output
        assert time.perf_counter() - start < 15
    assert not (tmp_path / "out").exists()


def test_a_missing_model_directory_is_called_missing_and_records_nothing(tmp_path, tiny_model):
    from typer.testing import CliRunner

    from selfplay.cli import app

    (tmp_path / "empty").mkdir()
    for model, says in (
        ("./no/such/dir", "model directory ./no/such/dir does not exist"),
        (str(tmp_path / "nope"), "does not exist"),
        (str(tmp_path / "empty"), "holds no model (no config.json)"),
    ):
        res = CliRunner().invoke(
            app, ["generate", "--model", model, "--out", str(tmp_path / "g"), "--num-games", "1"]
        )
        assert res.exit_code == 1 and says in res.output, res.output
    # a mistyped --warm-start directory fails before the run records anything; the corrected
    # command is then not refused as "started with another configuration"
    base = ["iterate", "--name", "w", "--data-root", str(tmp_path / "data"), "--model",
            str(tiny_model), "--checkpoint-root", str(tmp_path / "ck")]  # fmt: skip
    start = time.perf_counter()
    res = CliRunner().invoke(app, [*base, "--warm-start", str(tmp_path / "typo")])
    assert res.exit_code == 1 and "--warm-start: model directory" in res.output, res.output
    assert time.perf_counter() - start < 20
    assert not (tmp_path / "data" / "w" / "manifest.json").exists()
    assert not (tmp_path / "g" / "generate.json").exists()


def test_a_line_that_is_not_an_object_is_skipped_on_resume(tiny_model, tmp_path):
    out = tmp_path / "out"
    cmd = _generate_cmd(out, tiny_model, 8, 4)
    assert subprocess.run(cmd, env=_env(), capture_output=True).returncode == 0
    games = out / "games.jsonl"
    lines = games.read_bytes().splitlines(keepends=True)
    games.write_bytes(b"".join(lines[:3]) + b"[1, 2]\n" + b"".join(lines[4:]))
    res = subprocess.run(cmd, env=_env(), capture_output=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    assert b"games.jsonl:4: skipping a corrupt line" in res.stderr
    again = games.read_bytes().splitlines()
    assert again[-1] == b"[1, 2]"  # kept, after the games (convert skips it by number)
    assert [orjson.loads(x)["game_id"] for x in again[:-1]] == _plan_ids(out, tiny_model, 8)


def test_small_faults_each_get_one_clear_line(tmp_path, tiny_model):
    """generate.json missing or corrupt beside games; eval --baselines in scripted pair mode; a
    table size out of the game's range; a partner name; a refused sft leaves no folder."""
    from typer.testing import CliRunner

    from selfplay.cli import app

    def run(*args: str):
        return CliRunner().invoke(app, list(args))

    out = tmp_path / "g"
    out.mkdir()
    (out / "games.jsonl").write_text('{"game_id": "x"}\n')
    gen = ("generate", "--model", str(tiny_model), "--out", str(out), "--num-games", "1")
    res = run(*gen)
    assert res.exit_code == 1 and "holds games but no generate.json" in res.output, res.output
    (out / "generate.json").write_text("{torn")
    res = run(*gen)
    assert res.exit_code == 1 and "generate.json is not a generate.json" in res.output, res.output
    # a key this selfplay does not know, or one the new options leave at its old default
    from selfplay.generate.config import GenerateConfig

    ident = GenerateConfig(out=out, num_games=1, model=str(tiny_model)).identity()
    for extra, says in (({"bogus": 1}, "bogus: was 1"), ({"policy_seat": 2}, "policy_seat: was 2")):
        (out / "generate.json").write_text(orjson.dumps({"identity": ident | extra}).decode())
        res = run(*gen)
        assert res.exit_code == 1 and says in res.output, res.output
    res = run("eval", "--players", "cooperative,shy", "--baselines", "bogus")
    assert res.exit_code == 1 and "--baselines" in res.output
    res = run("generate", "--table-size", "0", "--model", "m", "--out", str(tmp_path / "t"))
    assert res.exit_code == 1 and "sizes are 3 to 8, not 0" in res.output, res.output
    res = run("generate", "--partner", "greedy", "--model", "m", "--out", str(tmp_path / "t"))
    assert (
        res.exit_code == 1
        and "inquisitive" in res.output
        and "game's scripted players" in (res.output)
    )
    sft_out = tmp_path / "sft"
    res = run("sft", "--model", str(tiny_model), "--out", str(sft_out), "--teacher",
              "scripted:cooperative", "--num-games", "1", "--mini-batch-size", "64")  # fmt: skip
    assert res.exit_code == 1 and "fewer than one mini-batch" in res.output, res.output
    assert not sft_out.exists()


def test_convert_skips_a_record_of_a_game_it_does_not_know(tmp_path):
    from selfplay.convert import ConvertConfig, convert
    from tests.test_convert import game, write

    chess = game("c", "A", 0.5).model_dump(mode="json")
    chess["game"] = "chess"
    games = write(
        tmp_path / "games.jsonl",
        [game("a1", "A", 0.2), game("a2", "A", 0.8), orjson.dumps(chess) + b"\n"],
    )
    summary = convert(ConvertConfig(games=games, out=tmp_path))
    assert summary.games_read == 2 and summary.lines_skipped == 1
    assert "'chess' is not a game this selfplay knows" in summary.skipped[0][1]


# --- planted links: an output path that is a symbolic link is refused, never written through ---


def test_a_link_planted_at_an_output_is_refused_and_its_target_untouched(tiny_model, tmp_path):
    """OUT/games.jsonl a dangling link or a link to an empty file: generate refuses at once,
    naming the path; the target is neither created nor written, the link is not replaced. The
    library's other writers (atomic files, appended lines) refuse a link the same way."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "empty.jsonl").touch()
    for target in (elsewhere / "missing.jsonl", elsewhere / "empty.jsonl"):
        out = tmp_path / f"out-{target.stem}"
        out.mkdir()
        (out / "games.jsonl").symlink_to(target)
        res = subprocess.run(_generate_cmd(out, tiny_model, 4, 4), env=_env(), capture_output=True)
        err = res.stderr.decode()
        assert res.returncode == 1, err[-3000:]
        assert f"{out / 'games.jsonl'} is a symbolic link" in err and "Traceback" not in err, err
        assert (out / "games.jsonl").is_symlink()
    assert not (elsewhere / "missing.jsonl").exists()
    assert (elsewhere / "empty.jsonl").read_bytes() == b""
    from selfplay.fileio import LinkRefused, atomic_write, open_output

    link = tmp_path / "manifest.json"
    link.symlink_to(elsewhere / "empty.jsonl")
    with pytest.raises(LinkRefused, match=r"manifest\.json is a symbolic link"):
        atomic_write(link, "{}")
    with pytest.raises(LinkRefused, match=r"manifest\.json is a symbolic link"):
        open_output(link, "ab")
    assert link.is_symlink() and (elsewhere / "empty.jsonl").read_bytes() == b""


# --- a run removes only what its own manifest says it left unfinished ------------------------


def _iterate_cmd(root: Path, model: Path, data_root: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "selfplay", "iterate", "--name", "same", "--model", str(model),
        "--data-root", str(root / data_root), "--checkpoint-root", str(root / "ck"),
        "--iterations", "1", "--games-per-iter", "4", "--games-per-scenario", "4",
        "--table-size", "3", "--max-new-tokens", "16", "--max-actions", "4",
        "--eval-scenarios", "0", "--no-report", *extra,
    ]  # fmt: skip


def test_a_new_run_never_deletes_an_earlier_runs_model(tiny_model, tmp_path):
    """The same --name and --checkpoint-root with another --data-root: the finished round_0
    model (and a user's file in it) and warm start of an earlier run are in the way. The new
    run refuses, naming the folder, and deletes nothing; a folder its own manifest says it left
    unfinished (a killed train) is still removed on resume."""
    earlier = {}
    for stage in ("warm_start", "round_0"):
        folder = tmp_path / "ck" / "same" / stage
        folder.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "my-notes.txt"):
            (folder / name).write_text(f"{stage} {name}")
        earlier[stage] = folder
    res = subprocess.run(
        _iterate_cmd(tmp_path, tiny_model, "data2", "--warm-start", "scripted:cooperative:4"),
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"{earlier['warm_start']} is in the way of run 'same''s warm start" in res.stderr
    assert "Traceback" not in res.stderr
    res = subprocess.run(
        _iterate_cmd(tmp_path, tiny_model, "data3"), env=_env(), capture_output=True, text=True
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"{earlier['round_0']} is in the way of run 'same''s round 0 train" in res.stderr
    assert "move it away or delete it yourself" in res.stderr.lower()
    for stage, folder in earlier.items():
        assert sorted(p.name for p in folder.iterdir()) == [
            "config.json", "model.safetensors", "my-notes.txt"
        ]  # fmt: skip
        assert (folder / "my-notes.txt").read_text() == f"{stage} my-notes.txt"
    # this run's own leftover (its manifest lists it as begun): removed, and the run finishes
    manifest = tmp_path / "data3" / "same" / "manifest.json"
    data = orjson.loads(manifest.read_bytes())
    data["unfinished"] = [str(earlier["round_0"].resolve())]
    manifest.write_bytes(orjson.dumps(data))
    res = subprocess.run(
        _iterate_cmd(tmp_path, tiny_model, "data3"), env=_env(), capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "left unfinished by this run's round 0 train" in res.stderr
    assert not (earlier["round_0"] / "my-notes.txt").exists()
    assert orjson.loads(manifest.read_bytes())["unfinished"] == []


def test_train_and_sft_never_write_into_a_folder_of_other_files(tiny_model, tmp_path):
    """`train --out DIR` and `sft --out DIR` where DIR holds the user's README.md and
    metrics.json (names a model folder also has): refused at once, naming the folder and the
    files, which stay as they were; nothing is trained or played."""
    theirs = tmp_path / "mine"
    theirs.mkdir()
    (theirs / "README.md").write_text("my notes")
    (theirs / "metrics.json").write_text('{"mine": true}')
    data = tmp_path / "train.parquet"
    data.touch()
    for args in (
        ["train", "--data", str(data)],
        ["sft", "--teacher", "scripted:cooperative", "--num-games", "4"],
    ):
        cmd = [sys.executable, "-m", "selfplay", *args, "--model", str(tiny_model),
               "--out", str(theirs)]  # fmt: skip
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 1, res.stderr[-3000:]
        said = " ".join(res.stderr.split())
        assert f"{theirs} already holds files this command did not write" in said, said
        assert "README.md, metrics.json" in said and "Traceback" not in said, said
        assert sorted(p.name for p in theirs.iterdir()) == ["README.md", "metrics.json"]
        assert (theirs / "README.md").read_text() == "my notes"
        assert (theirs / "metrics.json").read_text() == '{"mine": true}'


def test_a_run_name_is_one_folder_and_its_rule_is_said_in_words(tmp_path):
    """EXP_NAME=../../x for generate (its default folder data/$EXP_NAME) is refused as iterate
    refuses --name ../x: nothing is written outside data/, and the error says what a name may
    contain instead of printing the pattern."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    env = _env(EXP_NAME="../../x", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    for args in (["generate", "--model", "m", "--num-games", "1"], ["iterate", "--model", "m"]):
        res = subprocess.run(
            [sys.executable, "-m", "selfplay", *args], cwd=work, env=env, capture_output=True
        )
        said = " ".join(res.stderr.decode().split())
        assert res.returncode == 1, said
        assert "'../../x' is not a run name: a name is letters, digits, '.', '_' and '-'" in said
        assert "[A-Za-z0-9]" not in said and "Traceback" not in said, said
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b"]


def test_an_engine_answer_that_is_not_json_says_what_the_server_sent(tiny_model, tmp_path):
    """A healthy server at --engine-url that answers generate with an HTML page (a proxy's):
    one line naming the server and showing the start of what it sent, not a JSONDecodeError."""
    from tests.servers import not_json_server

    with not_json_server() as url:
        cmd = [sys.executable, "-m", "selfplay", "generate", "--engine", "sglang",
               "--engine-url", url, "--model", str(tiny_model), "--out", str(tmp_path / "g"),
               "--num-games", "1", "--table-size", "3"]  # fmt: skip
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    said = " ".join(res.stderr.split())
    assert res.returncode == 1, said[-3000:]
    assert f"server at {url} answered /generate with something that is not JSON" in said, said
    assert "'<html><body>502 Bad Gateway: the upstream engine is asleep" in said, said
    assert "JSONDecodeError" not in said and "Traceback" not in said, said


def test_a_truncated_warm_start_model_is_refused_before_the_manifest(tiny_model, tmp_path):
    """--warm-start DIR whose model.safetensors was cut short (a copy that did not finish):
    refused at once naming the file, with no manifest written, so the command with the copy
    redone runs instead of being refused as a run started with other options."""
    import shutil

    copy = tmp_path / "copied"
    shutil.copytree(tiny_model, copy)
    weights = copy / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    cmd = _iterate_cmd(tmp_path, tiny_model, "data", "--warm-start", str(copy))
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    said = " ".join(res.stderr.split())
    assert res.returncode == 1, said[-3000:]
    assert f"--warm-start: {weights} is cut short ({len(whole) // 2} bytes of the" in said, said
    assert "Traceback" not in said, said
    assert not (tmp_path / "data" / "same" / "manifest.json").exists()
