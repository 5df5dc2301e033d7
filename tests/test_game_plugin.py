"""A game from another package: a distribution that declares an entry point in the group
``selfplay.games`` adds a game without editing this repository. ``--game NAME`` finds it, the
game contract (``check_game``) runs before its first use, and a broken one is refused naming the
property it breaks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from selfplay.records import ReadReport, iter_game_records

TOY = Path(__file__).with_name("toy_game.py")


def _install(site: Path) -> None:
    """A package `sum_game_plugin` (the sum game of tests/toy_game.py, and a broken copy of it)
    and its installed metadata with the two entry points, in the folder ``site``."""
    package = site / "sum_game_plugin"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(TOY, package / "game.py")
    (package / "broken.py").write_text(
        "from sum_game_plugin.game import SumGame\n\n\n"
        "class BrokenGame(SumGame):\n"
        "    name = 'broken-sum'\n"
        "    baselines = ('nobody',)  # not one of its scripted players\n\n\n"
        "BROKEN = BrokenGame()\n"
    )
    info = site / "sum_game_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sum-game-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[selfplay.games]\n"
        "sum = sum_game_plugin.game:SUM\n"
        "broken-sum = sum_game_plugin.broken:BROKEN\n"
    )


def _generate(site: Path, model: Path, out: Path, game: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "selfplay", "generate", "--game", game, "--model", str(model),
           "--out", str(out), "--num-games", "2", "--games-per-scenario", "2",
           "--table-size", "1", "--max-new-tokens", "8", "--max-actions", "4"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_an_installed_game_plays_through_generate_and_a_broken_one_is_refused(
    tiny_model, tmp_path, monkeypatch
):
    from selfplay.game import GAMES

    site = tmp_path / "site"
    _install(site)
    res = _generate(site, tiny_model, tmp_path / "g", "sum")
    assert res.returncode == 0, res.stderr[-3000:]
    monkeypatch.syspath_prepend(str(site))  # the package installed here too, to read its records
    report = ReadReport()
    try:
        games = list(iter_game_records(tmp_path / "g" / "games.jsonl", report))
    finally:
        GAMES.pop("sum", None)  # registered by the first lookup: leave the registry as it was
    assert [g.game.name for g in games] == ["sum", "sum"], report.skipped
    assert type(games[0].scenario).__module__ == "sum_game_plugin.game"
    bad = _generate(site, tiny_model, tmp_path / "b", "broken-sum")
    said = " ".join((bad.stdout + bad.stderr).split())
    assert bad.returncode != 0
    assert "broken-sum" in said and "sum_game_plugin.broken:BROKEN" in said, said[-2000:]
    assert "baselines" in said and "nobody" in said, said[-2000:]
    unknown = _generate(site, tiny_model, tmp_path / "u", "no-such-game")
    said = unknown.stdout + unknown.stderr
    assert unknown.returncode != 0 and "unknown game 'no-such-game'" in said
