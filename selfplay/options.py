"""Command-line options built from the pydantic config fields: each option is declared once.

A config field is the one declaration of its option: the type, the default, the bounds (``ge``,
``le``, ``gt``, ``lt``), the help (``description``) and an environment variable
(``json_schema_extra={"envvar": "NAME"}``). A command takes the options of one or more configs and
builds its config from the values it gets (with the same ``Fields``), instead of restating each
option three times::

    GENERATE = Fields(GenerateConfig, exclude=("out", "sampling.seed"))

    @app.command("generate")
    @options(GENERATE, HF)
    def generate(out: Path | None = typer.Option(None, help="..."), **opts) -> None:
        cfg = build(GENERATE, opts, out=out or default_dir())

How a field becomes an option:
- ``X | None`` is an optional ``X``; a nested model (``sampling: SamplingParams``) is flattened
  into its fields (``--temperature``, ``--top-p``, ...), named by the leaf;
- a ``Literal`` or an ``Enum`` is a plain ``str`` (or ``int``) whose choices the help names; a
  ``bool`` is a ``--x/--no-x`` flag; a ``tuple[str, ...]`` is a repeatable option;
- ``ge``/``le`` become typer's ``min``/``max`` (checked while parsing, exit 2); an open bound
  (``gt``, ``lt``) is shown in the help and, like a choice, checked when the config is built;
- a field that becomes an option without a description is an error when the command is declared.

Checks across fields stay in the configs: ``build`` turns their ``ValidationError`` into an
``OptionError`` (a ``UserError``) that names the option to fix.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import typer
from pydantic import BaseModel, PlainSerializer, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from selfplay.engines import ENGINE_KINDS, HFEngineConfig, SGLangEngineConfig, VLLMEngineConfig
from selfplay.errors import UserError
from selfplay.evaluate.config import EvalConfig
from selfplay.generate.config import GenerateConfig
from selfplay.iterate.config import IterateConfig
from selfplay.iterate.warm_start import SFTConfig
from selfplay.train.config import TrainConfig, TrainerOptions

__all__ = ["Fields", "OptionError", "build", "explain", "options"]  # and the commands' specs below


class OptionError(UserError, ValueError):
    """A config refused the options it was built from; the message names the option to fix."""


@dataclass(frozen=True)
class Fields:
    """Which fields of ``model`` are options, and how.

    ``include``/``exclude``: dotted field paths (``"sampling"`` covers ``"sampling.top_p"``);
    default: every field. ``first``: paths shown first in the help, in this order (the others
    follow in the model's order). ``rename``: path -> option name, as a Python identifier
    (``{"url": "engine_url"}``); it names a renamed field in error messages too, included or not.
    ``override``: path -> typer.Option keywords, plus ``default``, ``decls`` (the option's
    flags) and ``prefix``. ``prefix`` starts every help (an option two engines share says so).
    """

    model: type[BaseModel]
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    first: tuple[str, ...] = ()
    rename: Mapping[str, str] = field(default_factory=dict)
    override: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    prefix: str = ""

    @classmethod
    def of(cls, spec: Fields | type[BaseModel]) -> Fields:
        return spec if isinstance(spec, Fields) else cls(spec)

    def name(self, path: str) -> str:
        """The option (as an identifier) of a field path, whether or not it is an option."""
        return self.rename.get(path, path.rpartition(".")[2])

    def selected(self) -> list[tuple[str, FieldInfo, Any]]:
        """The (path, field, default) of each field that is an option, in help order."""
        chosen = [
            leaf
            for leaf in _leaves(self.model)
            if not any(_covers(x, leaf[0]) for x in self.exclude)
            and (self.include is None or any(_covers(x, leaf[0]) for x in self.include))
        ]

        def rank(path: str) -> int:
            return next((i for i, x in enumerate(self.first) if _covers(x, path)), len(self.first))

        chosen.sort(key=lambda leaf: rank(leaf[0]))  # stable: the rest keep the model's order
        names: dict[str, str] = {}
        for path, _, _ in chosen:
            if (other := names.setdefault(self.name(path), path)) != path:
                raise TypeError(
                    f"{self.model.__name__}: {other} and {path} would both be "
                    f"--{_flag(self.name(path))}; exclude or rename one"
                )
        return chosen


def _covers(prefix: str, path: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _submodel(annotation: Any) -> type[BaseModel] | None:
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if is_model else None


def _leaves(
    model: type[BaseModel], prefix: str = "", base: BaseModel | None = None
) -> Iterator[tuple[str, FieldInfo, Any]]:
    """Every (dotted path, field, default) of ``model``, nested models flattened (a nested
    field's default is its value in the parent's default)."""
    for name, f in model.model_fields.items():
        path = prefix + name
        default = f.get_default(call_default_factory=True) if base is None else getattr(base, name)
        if (sub := _submodel(f.annotation)) is not None:
            yield from _leaves(sub, path + ".", default if isinstance(default, sub) else None)
        else:
            yield path, f, default


def _cli_type(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    """The type typer parses a field's value as, and the field's choices (if it has some)."""
    optional = False
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not NoneType]
        optional = len(args) < len(get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"{annotation} cannot be one option; build it in the command")
        annotation = args[0]
    choices: tuple[Any, ...] = ()
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        annotation = type(choices[0])
    elif isinstance(annotation, type) and issubclass(annotation, Enum):
        choices = tuple(e.value for e in annotation)
        annotation = type(choices[0])
    elif get_origin(annotation) in (tuple, list):
        item = get_args(annotation)[0]
        if get_origin(annotation) is tuple and get_args(annotation)[1:] != (...,):
            raise TypeError(f"{annotation} cannot be one option; use tuple[X, ...]")
        annotation = list[item]
    if annotation not in (str, int, float, bool, Path) and get_origin(annotation) is not list:
        raise TypeError(f"{annotation} cannot be one option; build it in the command")
    return (annotation | None if optional else annotation), choices


def _stored_type(f: FieldInfo) -> Any:
    """The type a field is given as on the command line: its stored form where it holds an
    object given by a name (a game, a partner: ``PlainSerializer``'s return type), else its own."""
    stored = next((m for m in f.metadata if isinstance(m, PlainSerializer)), None)
    return f.annotation if stored is None else stored.return_type


def _describe_range(f: FieldInfo) -> str:
    """A field's bounds as typer shows them (``x>=1``, ``x>0``, ``0<=x<1``)."""
    low = high = None
    for m in f.metadata:
        match m:
            case at.Gt(gt=v):
                low = (v, "<")
            case at.Ge(ge=v):
                low = (v, "<=")
            case at.Lt(lt=v):
                high = (v, "<")
            case at.Le(le=v):
                high = (v, "<=")
    if low and not high:
        return f"x{low[1].replace('<', '>')}{low[0]}"
    lo = f"{low[0]}{low[1]}" if low else ""
    return f"{lo}x{high[1]}{high[0]}" if high else f"{lo}x"


def _option(spec: Fields, path: str, f: FieldInfo, default: Any) -> tuple[Any, Any]:
    """The ``Annotated[type, typer.Option(...)]`` of a field and the option's default."""
    over = dict(spec.override.get(path, {}))
    decls = tuple(over.pop("decls", ()))
    default = over.pop("default", default)
    if default is PydanticUndefined:
        default = ...  # required
    elif isinstance(default, Enum):
        default = default.value
    elif isinstance(default, tuple):
        default = list(default)
    annotation, choices = _cli_type(_stored_type(f))
    text = over.pop("help", None) or f.description
    if not text:
        raise TypeError(
            f"{spec.model.__name__}.{path} is the option --{_flag(spec.name(path))} but has no "
            "description (its help): add Field(description=...) or exclude it"
        )
    kwargs: dict[str, Any] = {}
    if isinstance(f.json_schema_extra, dict) and "envvar" in f.json_schema_extra:
        kwargs["envvar"] = f.json_schema_extra["envvar"]
    bounds = {type(m): m for m in f.metadata if isinstance(m, at.Ge | at.Le | at.Gt | at.Lt)}
    if at.Gt in bounds or at.Lt in bounds:  # typer has none: shown here, checked by the config
        text += f"  [{_describe_range(f)}]"
    elif bounds:
        kwargs["min"] = getattr(bounds.get(at.Ge), "ge", None)
        kwargs["max"] = getattr(bounds.get(at.Le), "le", None)
    if choices and not all(str(c) in text for c in choices):  # checked by the config
        text += " One of: " + ", ".join(str(c) for c in choices) + "."
    prefix = over.pop("prefix", spec.prefix)
    info = typer.Option(*decls, help=prefix + text, **(kwargs | over))
    return Annotated[annotation, info], default


def options(*specs: Fields | type[BaseModel]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the options of these configs: after its own parameters, before those
    after a bare ``*`` (the order of ``--help``).

    The command takes them as ``**opts`` (``{option name: value}``) and builds its configs with
    ``build``. A field in two specs is one option (the first spec's); a parameter of the command
    itself (a CLI-only option, or one it builds by hand) wins over a field of the same name.
    """
    fields = [Fields.of(s) for s in specs]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        if len(own) == len(sig.parameters):
            raise TypeError(f"{fn.__name__} takes its config options as **opts")
        params = [p.replace(kind=p.KEYWORD_ONLY) for p in own if p.kind is not p.KEYWORD_ONLY]
        last = [p for p in own if p.kind is p.KEYWORD_ONLY]
        taken = {p.name for p in own}
        for spec in fields:
            for path, f, default in spec.selected():
                if (name := spec.name(path)) not in taken:
                    taken.add(name)
                    ann, default = _option(spec, path, f, default)
                    kind = inspect.Parameter.KEYWORD_ONLY
                    params.append(inspect.Parameter(name, kind, default=default, annotation=ann))
        params += last
        # typer reads both: inspect.signature(fn) and typing.get_type_hints(fn)
        fn.__signature__ = sig.replace(parameters=params)
        fn.__annotations__ = {p.name: p.annotation for p in params}
        fn.__annotations__["return"] = sig.return_annotation
        return fn

    return decorate


def build(spec: Fields | type[BaseModel], values: Mapping[str, Any], /, **explicit: Any):
    """``spec.model`` from a command's option ``values`` (those ``options(spec)`` gave it) and the
    ``explicit`` fields the command works out itself; raises ``OptionError`` naming the option a
    check refused."""
    spec = Fields.of(spec)
    data: dict[str, Any] = {}
    for path, _, _ in spec.selected():
        if (name := spec.name(path)) in values:
            *parents, leaf = path.split(".")
            node = data
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = values[name]
    data |= explicit  # a nested model given whole replaces its options
    try:
        return spec.model.model_validate(data)
    except ValidationError as e:
        raise OptionError(explain(e, spec)) from None


def explain(e: ValidationError, spec: Fields | type[BaseModel]) -> str:
    """``--option: message`` for a config's first validation error. A check across fields names
    its field first (``"ray_address: needs --gpus"``); that field is then the option named."""
    spec = Fields.of(spec)
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"] if not isinstance(x, int)]
    msg = err["msg"].removeprefix("Value error, ")
    m = re.match(r"(\w+): (.*)", msg, re.S)
    if m and ".".join([*loc, m[1]]) in {path for path, _, _ in _leaves(spec.model)}:
        loc, msg = [*loc, m[1]], m[2]
    if not loc:  # a check across fields that names its options in its message
        return msg
    return f"--{_flag(spec.name('.'.join(loc)))}: {msg}"


# ---------------------------------------------------------------------------------------------
# The commands' options: which config fields each command takes (selfplay.commands has them).
HF = Fields(
    HFEngineConfig,
    include=("device", "dtype", "max_batch_size", "prefix_cache_tokens", "deterministic"),
    override={"dtype": {"prefix": "hf, vllm: "}},
    prefix="hf: ",
)
# What both server engines take: declared once (by SGLANG, which comes first), read by both.
_SERVER_RENAME = {
    "url": "engine_url",
    "startup_timeout_s": "health_timeout",
    "deadline_s": "engine_deadline",
}
SGLANG = Fields(
    SGLangEngineConfig,
    include=(
        "startup_timeout_s",
        "tp_size",
        "deadline_s",
        "python",
        "port",
        "mem_fraction",
        "extra_args",
    ),
    rename=_SERVER_RENAME
    | {"python": "sglang_python", "port": "sglang_port", "extra_args": "sglang_arg"},
    override={
        x: {"prefix": "sglang, vllm: "} for x in ("startup_timeout_s", "tp_size", "deadline_s")
    },
    prefix="sglang: ",
)
VLLM = Fields(
    VLLMEngineConfig,
    include=(
        "startup_timeout_s",
        "tp_size",
        "deadline_s",
        "dtype",
        "python",
        "port",
        "max_model_len",
        "gpu_memory_utilization",
        "cpu_kv_cache_gb",
        "extra_args",
    ),
    rename=_SERVER_RENAME
    | {
        "python": "vllm_python",
        "port": "vllm_port",
        "max_model_len": "vllm_max_model_len",
        "gpu_memory_utilization": "vllm_gpu_memory",
        "cpu_kv_cache_gb": "vllm_kv_cache_gb",
        "extra_args": "vllm_arg",
    },
    prefix="vllm: ",
)
GENERATE = Fields(
    GenerateConfig,
    exclude=("out", "model", "partner_concurrency", "sampling.seed"),
    first=("num_games", "games_per_scenario", "sampling"),
    override={"num_games": {"default": 200}},
)
TRAIN = Fields(
    TrainConfig,
    include=("epochs", *TrainerOptions.model_fields, "seed", "resume_from"),
    first=("epochs",),
)
SFT = Fields(SFTConfig, exclude=("model", "max_actions", "ray_address", "save_verl_checkpoint"))
EVAL = Fields(
    EvalConfig,
    exclude=(
        "models",
        "num_scenarios",
        "baselines",
        "engine",
        "human_data",
        "out",
        "sampling.seed",
    ),
    rename={"models.label": "models", "models.model": "models"},
    override={"sampling.temperature": {"envvar": None}},  # greedy unless asked
)
ITERATE = Fields(
    IterateConfig,
    exclude=("model", "engine", "loggers", "sampling.seed"),
    first=(
        "iterations",
        "games_per_iter",
        "epochs_per_iter",
        "name",
        "data_root",
        "checkpoint_root",
        "seed",
        "sampling",
        "games_per_scenario",
    ),
    override={"iterations": {"default": 5}, "name": {"default": "selfplay"}},
)

# Options that no config holds.
EngineOption = Annotated[
    str,
    typer.Option(
        help=f"The engine: {', '.join(ENGINE_KINDS)} (hf: transformers in-process; sglang, "
        "vllm: a server, launched or attached)."
    ),
]
EngineUrlOption = Annotated[
    str | None,
    typer.Option(help="sglang, vllm: attach to a running server (or router) at this URL."),
]
LoggerOption = Annotated[
    str,
    typer.Option(
        "--logger",
        help="Experiment trackers, comma-separated, as verl names them: console, tensorboard, "
        "wandb, mlflow (swanlab, trackio where installed). WANDB_MODE=offline works offline.",
    ),
]
