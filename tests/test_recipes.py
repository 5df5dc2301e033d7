"""Recipe files (selfplay.recipe, `selfplay iterate --config`): every recipe in recipes/ is a run
config, a key or value the flag would refuse is refused naming the file and the key, a flag wins
over the file, a published run's manifest gives back its recorded config, a [warm-start-sft] table
builds the run's model first, and the demo recipe is the demo README times."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from selfplay.cli import app, parse_iterate
from selfplay.commands import train as train_commands
from selfplay.iterate.config import config_identity

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
# A run's manifest, or each seed's of a multi-seed run (docs/runs/NAME/seed-K/manifest.json).
MANIFESTS = sorted((ROOT / "docs" / "runs").glob("*/manifest.json")) + sorted(
    (ROOT / "docs" / "runs").glob("*/seed-*/manifest.json")
)


def _run_name(manifest: Path) -> str:
    """docs/runs/NAME for a run's manifest and for a seed's."""
    run = manifest.parent.parent if manifest.parent.name.startswith("seed-") else manifest.parent
    return run.name


# Where the published runs found the embedded model (models.embedded_model_dir on that machine).
RECORDED_EMBEDDED = Path("/root/.cache/selfplay/smollm2-135m-instruct")


def _model_dirs(root: Path, *paths: str) -> None:
    for p in paths:
        (root / p).mkdir(parents=True, exist_ok=True)
        (root / p / "config.json").write_text('{"model_type": "llama"}')


def _recipe_model(path: Path) -> str | None:
    m = re.search(r'^model = "(.*)"$', path.read_text(), re.MULTILINE)
    return m and m.group(1)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A fresh working folder, the embedded model at the path the published runs recorded (no
    conversion: nothing is loaded)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("selfplay.models.embedded_model_dir", lambda cache=None: RECORDED_EMBEDDED)
    for var in ("EXP_NAME", "NUM_ITERATIONS", "GAMES_PER_ITER", "EPOCHS_PER_ITER"):
        monkeypatch.delenv(var, raising=False)
    for var in ("INITIAL_MODEL", "MODEL_NAME"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_there_are_recipes():
    assert len(RECIPES) >= 20 and MANIFESTS


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_builds_an_iterate_config(recipe, here):
    """Parsed and checked into the run config, nothing run; the run is named as its file. A
    recipe that starts from a model directory finds it with a config.json."""
    if (model := _recipe_model(recipe)) is not None:
        _model_dirs(here, model)
    cfg = parse_iterate(["--config", str(recipe)])
    assert cfg.name == recipe.stem
    assert recipe.read_text().startswith(f"# selfplay iterate --config recipes/{recipe.stem}.toml")


def _sft_recipes() -> list[Path]:
    return [p for p in RECIPES if "[warm-start-sft]" in p.read_text()]


@pytest.mark.parametrize("recipe", _sft_recipes(), ids=lambda p: p.stem)
def test_a_warm_start_sft_table_builds_the_model_first_once(recipe, here, monkeypatch):
    """`iterate --config` runs `selfplay sft` with the table's options and --out MODEL while MODEL
    holds no model, and goes straight to the run once it does."""
    seen: dict = {}

    def sft_stops(logger, cfg, *rest):
        seen["sft"] = cfg
        raise KeyboardInterrupt  # stop here: the command says so and exits 130

    monkeypatch.setattr(train_commands, "tracked", sft_stops)
    monkeypatch.setattr("selfplay.iterate.iterate", lambda cfg, **_: seen.setdefault("run", cfg))
    model = _recipe_model(recipe)
    res = CliRunner().invoke(app, ["iterate", "--config", str(recipe)])
    assert res.exit_code == 130 and "run" not in seen, res.output
    sft = seen["sft"]
    assert sft.out == Path(model) and sft.teacher == "scripted:explainer" and sft.num_games == 96
    assert (sft.epochs, sft.lr, sft.mini_batch_size, sft.table_size) == (3, 1e-4, 4, 3)
    assert sft.game == parse_iterate(["--config", str(recipe)], resolve=False).game
    seen.clear()
    _model_dirs(here, model)
    monkeypatch.setattr("selfplay.iterate.report.write_report", lambda run_dir: run_dir)
    monkeypatch.setattr("selfplay.iterate.track.summary_line", lambda run, cfg: "done")
    res = CliRunner().invoke(app, ["iterate", "--config", str(recipe)])
    assert "sft" not in seen and seen["run"].model == model, res.output


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, named",
    [
        ('name = "x"\ntabel-size = 3\n', ["tabel-size", "not an option", "table-size"]),
        ('name = "x"\ngames-per-scenario = 1\n', ["games-per-scenario = 1", "greater than"]),
        ('name = "x"\ntable-size = 3.5\n', ["table-size = 3.5", "valid integer"]),
        ('name = "x"\neval-initial = "no"\n', ["eval-initial", "true or false"]),
        ('name = "x"\n[warm-start]\nlr = 1\n', ["[warm-start]", "unknown table"]),
        ('name = "x"\nmodel = "m"\n[warm-start-sft]\ntecher = 1\n', ["[warm-start-sft]", "techer"]),
        ('name = "x"\n[warm-start-sft]\nepochs = 1\n', ["[warm-start-sft]", "model = DIR"]),
        ("name = [\n", ["not TOML"]),
    ],
)
def test_a_bad_key_or_value_is_refused_naming_the_file_and_the_key(text, named, here):
    recipe = _write(here / "bad.toml", text)
    res = CliRunner().invoke(app, ["iterate", "--config", str(recipe), "--model", "m"])
    assert res.exit_code == 2, res.output
    message = " ".join(res.output.split())  # click wraps its error box
    for part in [str(recipe), *named]:
        assert part in message, message


def test_a_value_the_run_config_refuses_names_the_file_too(here):
    recipe = _write(here / "bad.toml", 'name = "x"\nalgorithm = "evolution"\n')
    res = CliRunner().invoke(app, ["iterate", "--config", str(recipe), "--model", "m"])
    assert res.exit_code == 1
    assert f"{recipe}: --algorithm" in res.output
    # the same value as a flag is the flag's error, without the file
    res = CliRunner().invoke(app, ["iterate", "--config", str(recipe), "--algorithm", "evolution"])
    assert res.exit_code == 1 and "--algorithm" in res.output and str(recipe) not in res.output


def test_flag_spellings_read_the_same(here):
    dashes = _write(here / "a.toml", 'name = "x"\ntable-size = 4\neval-initial = false\n')
    under = _write(here / "b.toml", 'name = "x"\ntable_size = 4\nno-eval-initial = true\n')
    a, b = (parse_iterate(["--config", str(p), "--model", "m"]) for p in (dashes, under))
    assert a == b and (a.table_size, a.eval_initial) == (4, False)


def test_a_flag_given_on_the_command_line_wins_over_the_file(here):
    demo = str(ROOT / "recipes" / "demo.toml")
    base = parse_iterate(["--config", demo])
    cfg = parse_iterate(["--config", demo, "--iterations", "3", "--eval-initial", "--lr", "2e-5"])
    assert (base.iterations, base.eval_initial, base.train.lr) == (1, False, 1e-5)
    assert (cfg.iterations, cfg.eval_initial, cfg.train.lr) == (3, True, 2e-5)
    assert cfg.model_copy(update={"iterations": 1, "eval_initial": False}).model_dump(
        exclude={"train"}
    ) == base.model_dump(exclude={"train"})
    # before or after --config: the command line wins either way
    assert parse_iterate(["--iterations", "3", "--config", demo]).iterations == 3


def _recorded(recorded: dict, rebuilt: dict, prefix: str = "") -> list[str]:
    """The recorded keys whose rebuilt value differs."""
    out = []
    for key, value in recorded.items():
        if isinstance(value, dict) and isinstance(rebuilt.get(key), dict):
            out += _recorded(value, rebuilt[key], f"{prefix}{key}.")
        elif rebuilt.get(key, "(absent)") != value:
            out.append(f"{prefix}{key}: {value!r} -> {rebuilt.get(key, '(absent)')!r}")
    return out


@pytest.mark.parametrize(
    "manifest", MANIFESTS, ids=lambda p: p.parent.relative_to(ROOT / "docs" / "runs").as_posix()
)
def test_a_published_manifest_gives_its_recorded_config(manifest, here):
    """`--config docs/runs/NAME/manifest.json`: every value the run recorded, and the same run
    for a resume (an option added since takes the value the run had)."""
    recorded = json.loads(manifest.read_text())["config"]
    if not recorded["model"].endswith("smollm2-135m-instruct"):
        _model_dirs(here, recorded["model"])
    cfg = parse_iterate(["--config", str(manifest)])
    assert _recorded(recorded, cfg.model_dump(mode="json")) == []
    assert cfg.identity() == config_identity(recorded)


def test_a_published_run_names_its_recipe():
    """docs/runs/NAME/RECIPE, for each recipe with a published run (scripts/publish_run.py)."""
    runs = {_run_name(p) for p in MANIFESTS}
    named = {name for name in runs if (ROOT / "docs" / "runs" / name / "RECIPE").is_file()}
    assert named == {p.stem for p in RECIPES} & runs
    for name in named:
        note = (ROOT / "docs" / "runs" / name / "RECIPE").read_text()
        assert note.startswith(f"recipe: recipes/{name}.toml\n")
        if (ROOT / "docs" / "runs" / name / "SEEDS.md").is_file():
            # A multi-seed run is run again by its recipe (a seed's manifest is one of its runs).
            assert note.endswith(f"selfplay iterate --config recipes/{name}.toml\n")


# `make demo`'s arguments before the recipes (the Makefile's DEMO_ARGS): what README times.
DEMO_ARGS = shlex.split(
    "--name demo --game matching-short --table-size 3 --warm-start scripted:cooperative:32 "
    "--warm-start-lr 2e-4 --warm-start-epochs 1 --warm-start-mini-batch-size 2 --iterations 1 "
    "--games-per-iter 8 --games-per-scenario 4 --temperature 1.0 --max-new-tokens 64 "
    "--max-actions 10 --lr 1e-5 --eval-scenarios 16 --micro-batch-size 4 --old-log-probs rollout "
    "--no-eval-initial"
)


def test_the_demo_recipe_is_the_one_readme_times(here):
    cfg = parse_iterate(["--config", str(ROOT / "recipes" / "demo.toml")])
    assert cfg == parse_iterate(DEMO_ARGS)
    assert cfg.train.dtype == "auto"  # the dtype rule picks per machine (bf16 only where native)
    assert cfg.train.old_log_probs == "rollout"


def test_the_makefile_runs_recipes():
    """make demo is the demo recipe, make run RECIPE=NAME any other; a few targets in all."""
    text = (ROOT / "Makefile").read_text()
    targets = re.findall(r"^([a-z][\w-]*):", text, re.MULTILINE)
    assert len(targets) <= 10 and {"setup", "test", "lint", "demo", "run"} <= set(targets)
    demo = re.search(r"^demo:.*\n\t(.*)$", text, re.MULTILINE)
    assert demo and demo.group(1) == ".venv/bin/selfplay iterate --config recipes/demo.toml"
    assert ".venv/bin/selfplay iterate --config recipes/$(RECIPE).toml" in text
    assert "_ARGS" not in text
