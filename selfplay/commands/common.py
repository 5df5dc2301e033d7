"""What the commands share: the console and the one-line error, the --engine check and the
engine config built from a command's options, SIGTERM as Ctrl-C, and the default data folder."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import typer
from rich.console import Console

from selfplay.engines import ENGINE_KINDS, engine_config_class
from selfplay.options import HF, SGLANG, VLLM, build

# soft_wrap: messages keep paths and commands on one line (copyable, greppable)
console = Console(stderr=True, soft_wrap=True)


def check_engine(kind: str, url: str | None) -> None:
    """Refuse an unknown --engine, and --engine-url without a server engine."""
    if kind not in ENGINE_KINDS:
        raise fail(f"--engine must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    if url and kind not in SERVERS:
        raise fail("--engine-url attaches to a server: add --engine sglang or --engine vllm")


SERVERS = {"sglang": SGLANG, "vllm": VLLM}  # the server engines' options


def engine_config(kind: str, url: str | None, opts: dict, model: str, **server):
    """The engine config of --engine (checked) from a command's HF, SGLANG and VLLM options;
    another engine gets its config's defaults."""
    if kind == "hf":
        return build(HF, opts, model=model)
    if kind in SERVERS:
        server.setdefault("deterministic", bool(opts.get("deterministic")))
        return build(SERVERS[kind], opts, model=model, url=url, **server)
    return engine_config_class(kind)(model=model)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM stops the command as Ctrl-C does (KeyboardInterrupt): what is finished is kept,
    servers and stage processes are stopped, and the same command resumes."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # KeyboardInterrupt
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def default_data_dir() -> Path:
    """generate's default folder (convert's, train's): data/$EXP_NAME, else data/generate.
    EXP_NAME is checked as iterate checks --name: a name, never a path out of data/."""
    from selfplay.fileio import check_name

    try:
        return Path("data") / check_name(os.environ.get("EXP_NAME") or "generate")
    except ValueError as e:
        raise fail(f"EXP_NAME: {e}") from None


def fail(message: str) -> typer.Exit:
    """Print one clear error line and return the exit to raise."""
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(1)
