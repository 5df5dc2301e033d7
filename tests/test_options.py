"""The CLI's options: every one has help, none is cut at 80 columns, and an option shared by
several commands is declared once (same help, bounds and, where it means the same, default)."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from selfplay.cli import app

COMMANDS = typer.main.get_command(app).commands
# declared once in cli.py and used by every command that has them (eval keeps its own greedy
# temperature and its own action limit, with no environment variable)
SHARED = (
    "temperature",
    "max_new_tokens",
    "max_actions",
    "max_invalid",
    "table_size",
    "concurrency",
    "seed",
    "games_per_scenario",
    "val_fraction",
    "max_length",
    "lr",
    "batch_size",
    "micro_batch_size",
    "kl_coef",
    "top_p",
    "partner",
    "policy_seat",
    "loss_agg",
    "logger",
)


def _options(command: str) -> dict:
    return {p.name: p for p in COMMANDS[command].params if p.param_type_name == "option"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help(command):
    missing = [n for n, p in _options(command).items() if not (p.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_at_80_columns_cuts_no_option_name(command):
    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0
    assert "…" not in res.output
    for p in _options(command).values():
        assert p.opts[0] in res.output


def _signature(p) -> tuple:
    envvar = (p.envvar,) if isinstance(p.envvar, str) else tuple(p.envvar or ())
    return (p.help, p.min, p.max, envvar)


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_option_is_the_same_everywhere(name):
    # eval and report keep their own (greedy eval, held-out seeds; the report's table size is the
    # baselines'), and sft's --partner is the teacher's scripted partner, not a played partner
    other = {"eval", "report"} | ({"sft"} if name == "partner" else set())
    found = {c: _options(c)[name] for c in COMMANDS if c not in other and name in _options(c)}
    assert len(found) >= 2, f"--{name} is not shared"
    assert len({_signature(p) for p in found.values()}) == 1, {
        c: _signature(p) for c, p in found.items()
    }


def test_val_fraction_default_is_the_same_in_convert_and_iterate():
    from selfplay.convert import ConvertConfig

    defaults = {c: _options(c)["val_fraction"].default for c in ("convert", "iterate")}
    assert set(defaults.values()) == {ConvertConfig.model_fields["val_fraction"].default} == {0.0}


@pytest.mark.parametrize("command", ["generate", "iterate"])
def test_groups_of_one_game_are_refused_alike(command, tmp_path):
    res = CliRunner().invoke(app, [command, "--games-per-scenario", "1"])
    assert res.exit_code == 2 and "--games-per-scenario" in res.output


def test_a_bad_value_names_the_option(tmp_path):
    res = CliRunner().invoke(app, ["convert", "--val-fraction", "1.5"])
    assert res.exit_code == 2 and "--val-fraction" in res.output
