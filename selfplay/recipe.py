"""Recipe files: an experiment's `selfplay iterate` options kept in a file, read by ``--config``.

A recipe (``recipes/NAME.toml``) holds the options of `selfplay iterate` under their flags' names
without the dashes (``table-size = 3``; ``table_size = 3`` reads the same), a ``--x/--no-x``
flag as ``x = true`` or ``x = false`` (``no-x = true`` reads too), a repeatable option as a list.
Its one table, ``[warm-start-sft]``, holds `selfplay sft` options the same way: the command that
builds the recipe's ``model`` directory (``--out``) before the run, when that directory holds no
model yet. A published run's ``manifest.json`` is read as a recipe too: its config snapshot,
option by option, so that the run is reproduced (an option added after the run takes the value
it had then, ``ADDED_LATER``).

The options become the command's defaults: a flag given on the command line (or its environment
variable) wins over the file. Every key is checked here against the command's own options, and
every value by the option's own type and bounds, as if it were typed after its flag; a check
across options is the config's, as for flags. Errors are ``RecipeError``s naming the file and
the key.
"""

from __future__ import annotations

import difflib
import json
import logging
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from selfplay.errors import UserError
from selfplay.iterate.config import ADDED_LATER, TRAIN_ADDED_LATER
from selfplay.options import HF, ITERATE, SGLANG, VLLM, Fields

__all__ = [
    "Recipe",
    "RecipeError",
    "command_defaults",
    "load_recipe",
    "manifest_options",
    "warm_start_sft",
]

logger = logging.getLogger(__name__)
Command = Any  # a click command as typer builds it (typer.main.get_command(app).commands[NAME])

SFT_TABLE = "warm-start-sft"
# Options a recipe does not hold: the file itself, and what a run does rather than what it is.
NOT_IN_A_RECIPE = frozenset({"config", "force", "help"})
# The engine options of each engine kind, as `selfplay iterate` takes them.
ENGINE_OPTIONS: dict[str, Fields] = {"hf": HF, "sglang": SGLANG, "vllm": VLLM}
# Where the embedded model lives on any machine (models.embedded_model_dir): a manifest's path
# ending so is the embedded model, found again wherever it is cached here.
EMBEDDED_TAIL = ("selfplay", "smollm2-135m-instruct")


class RecipeError(UserError, ValueError):
    """A recipe cannot be read: says which file and which key."""


@dataclass(frozen=True)
class Recipe:
    """A recipe read and checked: ``options`` (iterate's parameter name -> value as typed on the
    command line) and, if it has one, its ``[warm-start-sft]`` table (sft's, the same way)."""

    path: Path
    options: dict[str, Any]
    warm_start_sft: dict[str, Any] | None = None


def load_recipe(path: Path, iterate: Command, sft: Command) -> Recipe:
    """Read a recipe (TOML) or a published run's manifest (JSON) and check it against the click
    commands of `selfplay iterate` and `selfplay sft`; ``RecipeError`` names the file and key."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise RecipeError(f"{path}: cannot read it ({e.strerror})") from None
    if path.suffix == ".json":
        try:
            manifest = json.loads(text)
        except ValueError as e:
            raise RecipeError(f"{path}: not JSON ({e})") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
            raise RecipeError(f"{path}: not a run manifest (it has no config snapshot)")
        table: dict[str, Any] = manifest_options(manifest["config"], str(path))
    else:
        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise RecipeError(f"{path}: not TOML ({e})") from None
    sft_table = table.pop(SFT_TABLE, None)
    for key, value in table.items():
        if isinstance(value, dict):
            raise RecipeError(f"{path}: [{key}]: unknown table; the one table is [{SFT_TABLE}]")
    options = command_defaults(iterate, table, str(path))
    sft_options = None
    if sft_table is not None:
        if "model" not in options:
            raise RecipeError(
                f"{path}: [{SFT_TABLE}] builds the run's model directory: add model = DIR"
            )
        if {"out", "no-out"} & {k.replace("_", "-") for k in sft_table}:
            raise RecipeError(f"{path}: [{SFT_TABLE}] out: the table writes to the run's model")
        sft_options = command_defaults(sft, sft_table, f"{path} [{SFT_TABLE}]")
    return Recipe(path, options, sft_options)


def command_defaults(command: Command, table: Mapping[str, Any], source: str) -> dict:
    """``{parameter name: value as the command line gives it}`` from a recipe's ``table``: every
    key an option of ``command`` (flag spelling, ``_`` or ``-``), every value one its option
    takes (its type, bounds and choices, as click checks a flag's)."""
    flags = _flags(command)
    out: dict[str, Any] = {}
    ctx = typer.Context(command, info_name=command.name)  # for messages: nothing is parsed
    for key, value in table.items():
        flag = key.replace("_", "-")
        if flag not in flags:
            near = difflib.get_close_matches(flag, list(flags), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise RecipeError(f"{source}: {key}: not an option of `selfplay {command.name}`{hint}")
        param, negated = flags[flag]
        if param.name in out:
            raise RecipeError(f"{source}: {key}: --{flag} is set twice")
        try:
            out[param.name] = _value(param, value, negated)
            param.process_value(ctx, out[param.name])  # the flag's own check
        except (typer.BadParameter, ValueError) as e:
            message = e.format_message() if isinstance(e, typer.BadParameter) else str(e)
            raise RecipeError(f"{source}: {key} = {value!r}: {message}") from None
    return out


def _flags(command: Command) -> dict[str, tuple[Any, bool]]:
    """Each flag of ``command`` without its dashes -> (its option, whether it is the --no-x)."""
    flags: dict[str, tuple[Any, bool]] = {}
    for p in command.params:
        if p.param_type_name == "option" and p.name not in NOT_IN_A_RECIPE:
            flags |= {o.lstrip("-"): (p, False) for o in p.opts if o.startswith("--")}
            flags |= {o.lstrip("-"): (p, True) for o in p.secondary_opts}
    return flags


def _value(param: Any, value: Any, negated: bool) -> Any:
    """A recipe's value as the command line would give it: text, so that click parses it as it
    parses a flag's (``3.5`` is no integer there either); a flag's a TOML true or false."""
    if param.is_flag:
        if not isinstance(value, bool):
            raise ValueError("a flag: true or false")
        return value != negated
    if negated:
        raise ValueError("not a flag")
    if param.multiple:
        items = value if isinstance(value, list) else [value]
        return [_text(v) for v in items]
    if isinstance(value, list | dict):
        raise ValueError("one value, not a list")
    return _text(value)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def manifest_options(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A run manifest's config snapshot as `selfplay iterate` options (parameter name -> value):
    the options it was started with, those added since at the value they had then."""
    config = _with_added_later(config)
    engine = config.get("engine") or {}
    kind = engine.get("kind", "hf")
    if kind not in ENGINE_OPTIONS:
        raise RecipeError(f"{source}: engine kind {kind!r} has no options here")
    out: dict[str, Any] = {"model": _model(config["model"]), "engine": kind}
    if engine.get("url"):
        out["engine_url"] = engine["url"]
    out |= _spec_options(ITERATE, config)
    for name, value in _spec_options(ENGINE_OPTIONS[kind], engine).items():
        out.setdefault(name, value)  # dtype is one option, train's first (as in the command)
    if config.get("loggers"):
        out["logger"] = ",".join(config["loggers"])
    return out


def _with_added_later(config: Mapping[str, Any]) -> dict[str, Any]:
    config = {**ADDED_LATER, **config}
    config["train"] = {**TRAIN_ADDED_LATER, **(config.get("train") or {})}
    if config["train"].get("dtype") is None:  # before auto had a name
        config["train"]["dtype"] = "auto"
    return config


def _spec_options(spec: Fields, dump: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for path, _, _ in spec.selected():
        node: Any = dump
        for part in path.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None:  # None: the option's default, which is None wherever a run has it
            out[spec.name(path).replace("_", "-")] = node
    return out


def _model(model: str) -> str:
    return "embedded" if Path(model).parts[-2:] == EMBEDDED_TAIL else model


def warm_start_sft(recipe: Recipe, model: str, parent: typer.Context, sft: Command) -> bool:
    """Build the recipe's model directory with its ``[warm-start-sft]`` (`selfplay sft` with
    those options and ``--out MODEL``) when ``model`` is the recipe's and holds no model yet;
    True when it ran. Another ``--model`` given on the command line is the user's own model."""
    table = recipe.warm_start_sft
    if table is None or model != recipe.options["model"] or (Path(model) / "config.json").is_file():
        return False
    logger.info("%s: building %s with its [%s] first", recipe.path, model, SFT_TABLE)
    with sft.make_context(sft.name, [], parent=parent, default_map={**table, "out": model}) as ctx:
        sft.invoke(ctx)
    return True
