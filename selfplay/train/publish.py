"""Publishing a trained model: train into a hidden folder beside ``--out``, move the finished files
in (``config.json``, which marks a complete model, last), so that a failed, killed or disk-full
training leaves no half-written model; ``--out`` is never overwritten (it is a new or empty
folder, or refused) and a second train into it is refused at once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

from selfplay.errors import UserError
from selfplay.fileio import atomic_write, output_lock
from selfplay.train.batch import TrainDataError
from selfplay.train.config import TrainConfig


class Published(Protocol):
    """What a training returns (``TrainResult``): where it wrote the model and its files."""

    model_dir: Path
    metrics_path: Path
    checkpoint_dir: Path | None


TrainResult = TypeVar("TrainResult", bound=Published)

METRICS_FILENAME = "metrics.json"


class OutputExists(UserError, FileExistsError):
    """--out already holds a model or other files (it is never overwritten)."""


def check_new_output(out: Path, own: tuple[str, ...] = ()) -> None:
    """Refuse an ``out`` that exists with anything in it but ``own`` (entries the command itself
    writes there before training: sft's rows); a new or empty folder passes."""
    if (out / "config.json").exists():
        raise OutputExists(f"{out} already holds a model; choose another --out or delete it first")
    if out.exists() and not out.is_dir():
        raise OutputExists(f"{out} exists and is not a folder; choose another --out")
    others = sorted(p.name for p in out.iterdir() if p.name not in own) if out.exists() else []
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise OutputExists(
            f"{out} already holds files this command did not write ({shown}); the model's "
            "files would replace any of the same name, so --out must be a new or empty folder: "
            "choose another --out, or move those files away"
        )


def _check_out(cfg: TrainConfig) -> None:
    own: tuple[str, ...] = ()
    with contextlib.suppress(ValueError):  # rows kept inside --out (sft's) are its own
        own = Path(cfg.data).resolve().relative_to(cfg.out.resolve()).parts[:1]
    check_new_output(cfg.out, own)
    if cfg.resume_from is not None and not Path(cfg.resume_from).is_dir():
        raise TrainDataError(f"--resume-from {cfg.resume_from} is not a verl checkpoint directory")


class DiskFull(UserError, OSError):
    """The disk filled up while a model was written; nothing half-written is left."""


class OutOfMemory(UserError, MemoryError):
    """Training ran out of memory; the message says what to lower. Nothing half-written is left."""


# How an allocation that failed reads: oneDNN on CPU, torch's CPU and CUDA allocators, Python
_OOM = ("could not create a primitive", "can't allocate memory", "out of memory")


def _out_of_memory(e: BaseException, cfg: TrainConfig) -> OutOfMemory | None:
    """The clear error for a failed allocation ``e`` during training, or None for anything
    else (oneDNN says "could not create a primitive", a bare MemoryError says nothing)."""
    if not isinstance(e, MemoryError | RuntimeError) or isinstance(e, UserError):
        return None
    if isinstance(e, RuntimeError) and not any(m in str(e).lower() for m in _OOM):
        return None
    said = f"{type(e).__name__}: {e}".rstrip(": ") if str(e) else type(e).__name__
    return OutOfMemory(
        f"training ran out of memory ({said}); lower --micro-batch-size (now "
        f"{cfg.micro_batch_size}) or --max-length (now {cfg.max_length}), train in bf16 where "
        "the device supports it (--dtype), or use LoRA (--lora-rank) or more memory. Nothing "
        "was kept; re-run with the smaller setting"
    )


def publish(cfg: TrainConfig, run: Callable[[TrainConfig], TrainResult]) -> TrainResult:
    """Train into a hidden folder beside ``cfg.out``, then move the finished files into
    ``cfg.out`` (config.json, which marks a complete model, last): a failed, killed or
    disk-full training leaves no half-written model, and a retry starts clean. A second train
    into the same ``out`` is refused at once (``output_lock``)."""
    with output_lock(cfg.out, "selfplay train"):
        return _publish_locked(cfg, run)


class CustomCodeModel(UserError, ValueError):
    """A model whose config.json points at custom model code (``auto_map``)."""


def _check_no_custom_code(model: str) -> None:
    """Refuse, before any training, a model whose config.json has ``auto_map``: selfplay never
    runs a model's own code (it loads the transformers class of its architecture), and
    transformers cannot save such a config without that code, so the trained model would be
    lost at the very end."""
    config = Path(model) / "config.json"
    try:
        auto_map = json.loads(config.read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return  # a hub id, or no readable config: the loader says what is wrong
    if auto_map:
        raise CustomCodeModel(
            f"{config} names custom model code (auto_map: {', '.join(sorted(auto_map))}), which "
            "selfplay never runs; its trained copy could not be saved with it. Train a model "
            "of transformers' own architectures, or a copy of this one without auto_map in "
            "config.json if its architecture is one of them"
        )


def _publish_locked(cfg: TrainConfig, run: Callable[[TrainConfig], TrainResult]) -> TrainResult:
    _check_out(cfg)
    _check_no_custom_code(cfg.model)
    out = cfg.out
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with _scratch_tempdir():
            result = run(cfg.model_copy(update={"out": partial}))
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        free = shutil.disk_usage(out.parent if out.parent.exists() else Path.cwd()).free
        write_failed = getattr(e, "errno", None) in (errno.ENOSPC, errno.EFBIG) or any(
            m in str(e) for m in ("unexpected pos", "File too large", "No space left")
        )  # torch's writer reports a failed write as a RuntimeError without an errno
        if isinstance(e, OSError | RuntimeError) and (write_failed or free < _LOW_DISK):
            raise DiskFull(
                errno.ENOSPC,
                f"writing the model under {out.parent} failed: the disk filled up or a file-size "
                f"limit was reached ({type(e).__name__}: {e}); "
                f"{free / 2**20:.0f} MiB are free there and a model of "
                f"{_model_bytes(cfg.model) / 2**20:.0f} MiB needs at least that much again "
                f"({'about 4x with' if cfg.save_verl_checkpoint else 'more without'} "
                "--save-verl-checkpoint). Nothing was kept; free space and re-run",
            ) from None
        if (oom := _out_of_memory(e, cfg)) is not None:
            raise oom from None
        raise
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(partial.iterdir(), key=lambda p: p.name == "config.json"):
        os.replace(entry, out / entry.name)
    partial.rmdir()
    result.model_dir, result.metrics_path = out, out / METRICS_FILENAME
    if result.checkpoint_dir is not None:
        result.checkpoint_dir = out / result.checkpoint_dir.relative_to(partial)
    metrics = json.loads(result.metrics_path.read_text())
    metrics["config"]["out"] = str(out)
    atomic_write(result.metrics_path, json.dumps(metrics, indent=2) + "\n")
    return result


@contextlib.contextmanager
def _scratch_tempdir() -> Iterator[None]:
    """A private temporary folder for this process while it trains, removed afterwards: verl
    leaves a lock file in the temporary folder for every checkpoint directory it creates."""
    scratch = tempfile.mkdtemp(prefix="selfplay-train-")
    before, tempfile.tempdir = tempfile.tempdir, scratch
    try:
        yield
    finally:
        tempfile.tempdir = before
        shutil.rmtree(scratch, ignore_errors=True)


_LOW_DISK = 64 * 2**20  # below this much free space a failed write is taken for a full disk


def _model_bytes(model: str) -> int:
    return (
        sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))
        if Path(model).is_dir()
        else 0
    )
