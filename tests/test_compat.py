"""The verl compatibility layer: the version pin and the CPU platform.

If this file fails after a verl upgrade, the pin moved: port selfplay/compat.py and
selfplay/train/ to the new verl (its internals change between releases), then move the pin here,
in selfplay/compat.py and in pyproject.toml together.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from selfplay.train import compat

ROOT = Path(__file__).resolve().parents[1]


def test_installed_verl_is_the_pinned_version():
    assert compat.PINNED_VERL_VERSION == "0.9.1"
    installed = compat.installed_verl_version()
    assert installed == compat.PINNED_VERL_VERSION, (
        f"verl {installed} is installed but selfplay.train.compat is pinned to "
        f"{compat.PINNED_VERL_VERSION}: port compat.py and selfplay/train/ before moving the pin"
    )
    assert compat.check_verl_version() == compat.PINNED_VERL_VERSION


def test_pyproject_pins_the_same_verl():
    text = (ROOT / "pyproject.toml").read_text()
    pins = re.findall(r'"verl==([^"]+)"', text)
    assert pins == [compat.PINNED_VERL_VERSION]


def test_version_guard_refuses_another_verl(monkeypatch):
    monkeypatch.setattr(compat.metadata, "version", lambda name: "0.9.2")
    with pytest.raises(compat.VerlVersionError, match=r"verl 0.9.2 is installed .*verl==0.9.1"):
        compat.check_verl_version()

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.metadata, "version", missing)
    with pytest.raises(compat.VerlVersionError, match="not installed"):
        compat.check_verl_version()


def test_cpu_platform_installs_in_a_fresh_process():
    # a fresh interpreter: install before verl's engine is imported, as the trainer does
    code = """
from selfplay.train import compat
compat.install_cpu_platform()
compat.install_cpu_platform()  # idempotent
from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
from verl.workers.engine import EngineRegistry
import verl.workers.engine.fsdp.transformer_impl as ti
assert get_device_name() == "cpu", get_device_name()
assert get_nccl_backend() == "gloo"
assert ti.device_name == "cpu"
assert get_torch_device().get_device_name() == "CPU"
assert get_torch_device().max_memory_allocated() == 0
assert "cpu" in EngineRegistry._engines["language_model"]["fsdp2"]
import verl.workers.engine_workers as ew
ew.initialize_global_process_group_ray()
import torch.distributed as dist
assert dist.get_backend() == "gloo"
dist.destroy_process_group()
print("ok")
"""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "RANK": "0", "WORLD_SIZE": "1"}
    import os

    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_worker_env_names_this_module():
    env = compat.cpu_worker_env()
    assert env["VERL_USE_EXTERNAL_MODULES"] == "selfplay.train.compat"
    assert env["VERL_PLATFORM"] == "cpu"
