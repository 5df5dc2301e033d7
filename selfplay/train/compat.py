"""The one place where selfplay adapts verl to run on a CPU (pinned to verl==0.9.1).

verl 0.9.1 resolves its device through ``verl.plugin.platform``; with no accelerator it falls back
to "nvidia" and every tensor goes to "cuda". This module registers a CPU platform (device "cpu",
collective backend gloo, a device-module shim whose memory and seed functions are no-ops), adds a
"cpu" key for the FSDP language-model engine, and makes verl's process-group set-up use plain gloo
(verl builds "cpu:gloo,cpu:gloo", which torch rejects).

It is version-guarded: ``check_verl_version()`` raises when the installed verl is not the pinned
one, because the internals touched here change between verl releases. The test
``tests/test_compat.py`` fails loudly when the pin moves.

Install the platform before anything imports ``verl.workers.engine*`` (the engine module caches
the device name at import): ``install_cpu_platform()`` in-process, or, for Ray workers, the
environment from ``cpu_worker_env()``, which makes verl import this module in each worker
(``VERL_USE_EXTERNAL_MODULES``) where the ``VERL_PLATFORM=cpu`` hook at the bottom installs it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import types
from importlib import metadata

from selfplay.errors import UserError

log = logging.getLogger(__name__)

PINNED_VERL_VERSION = "0.9.1"
CPU_PLATFORM = "cpu"


class VerlVersionError(UserError, RuntimeError):
    """The installed verl is not the version this compatibility layer was written for."""


def installed_verl_version() -> str | None:
    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return None


def check_verl_version() -> str:
    """Return the installed verl version; raise unless it is the pinned one."""
    version = installed_verl_version()
    if version is None:
        raise VerlVersionError(
            "verl is not installed; install the training extra: "
            f"pip install 'verl=={PINNED_VERL_VERSION}' uvicorn fastapi (after torch)"
        )
    if version != PINNED_VERL_VERSION:
        raise VerlVersionError(
            f"verl {version} is installed but selfplay.train.compat is written for "
            f"verl=={PINNED_VERL_VERSION}; "
            f"install verl=={PINNED_VERL_VERSION}, or port selfplay/compat.py and "
            "selfplay/train/ to the new version and move the pin"
        )
    return version


def _cpu_device_module() -> types.SimpleNamespace:
    """A stand-in for ``torch.cuda`` with the calls verl makes, answered for the CPU."""
    import torch

    m = types.SimpleNamespace()
    for name in (
        "current_device",
        "synchronize",
        "is_available",
        "device_count",
        "Stream",
        "stream",
    ):
        if hasattr(torch.cpu, name):
            setattr(m, name, getattr(torch.cpu, name))

    def zero(*_a, **_k) -> int:
        return 0

    def noop(*_a, **_k) -> None:
        return None

    for name in (
        "max_memory_allocated",
        "max_memory_reserved",
        "memory_allocated",
        "memory_reserved",
    ):
        setattr(m, name, zero)
    for name in (
        "empty_cache",
        "reset_peak_memory_stats",
        "manual_seed",
        "manual_seed_all",
        "set_device",
        "ipc_collect",
    ):
        setattr(m, name, noop)
    m.mem_get_info = lambda *_a, **_k: (0, 0)
    m.get_device_name = lambda *_a, **_k: "CPU"  # the FLOPs counter asks for it
    m.get_rng_state = torch.get_rng_state
    m.set_rng_state = torch.set_rng_state
    m.is_initialized = lambda: True
    m.current_stream = lambda *_a, **_k: None
    m.memory = types.SimpleNamespace(_set_allocator_settings=noop)
    return m


_platform_cls = None


def _register_platform():
    """Define and register the CPU platform class with verl's registry (once)."""
    global _platform_cls
    if _platform_cls is not None:
        return _platform_cls
    import torch
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import PlatformRegistry

    class PlatformCPU(PlatformCUDA):
        """verl platform for a machine without an accelerator: device "cpu", backend gloo."""

        _module = _cpu_device_module()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            return self._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # Never auto-detected: only chosen explicitly (VERL_PLATFORM=cpu or set_platform).
            return False

        def current_device(self):
            return "cpu"  # verl does tensor.to(get_device_id()); an int would mean cuda:N

        def device_count(self) -> int:
            return 1

        def set_device(self, i) -> None:
            pass

        def synchronize(self, i=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, i=0):
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_resource_options(self, num_gpus):
            return {"num_cpus": 1}

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    PlatformRegistry.register(platform=CPU_PLATFORM)(PlatformCPU)
    _platform_cls = PlatformCPU
    return PlatformCPU


def _force_plain_gloo() -> None:
    """verl's process-group init asks for "cpu:gloo,<device>:<ccl>"; on the CPU that is rejected."""
    import verl.utils.distributed as vd

    original = getattr(vd.initialize_global_process_group_ray, "__wrapped_by_selfplay__", None)
    if original is not None:
        return
    original = vd.initialize_global_process_group_ray

    def init_with_gloo(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    init_with_gloo.__wrapped_by_selfplay__ = original
    vd.initialize_global_process_group_ray = init_with_gloo
    # engine_workers binds the name at import; patch the binding too when it is already imported
    import sys

    ew = sys.modules.get("verl.workers.engine_workers")
    if ew is not None:
        ew.initialize_global_process_group_ray = init_with_gloo


def _register_cpu_engine() -> None:
    """Engines are registered for "cuda" and "npu" only; let the FSDP LM engine serve "cpu" too."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    registry = EngineRegistry._engines["language_model"]
    for backend in ("fsdp", "fsdp2"):
        registry[backend].setdefault("cpu", FSDPEngineWithLMHead)


_installed = False


def install_cpu_platform() -> None:
    """Make verl run on the CPU in this process. Idempotent; raises on another verl version."""
    global _installed
    if _installed:
        return
    check_verl_version()
    import sys

    from verl.plugin.platform.platform_manager import get_platform, set_platform

    if "verl.workers.engine.fsdp.transformer_impl" in sys.modules:
        cached = sys.modules["verl.workers.engine.fsdp.transformer_impl"].device_name
        if cached != "cpu":
            raise RuntimeError(
                "verl's FSDP engine was imported before the CPU platform was installed (it cached "
                f"device {cached!r}); call selfplay.train.compat.install_cpu_platform() before "
                "importing verl.workers.engine*, or run on a GPU"
            )
    cls = _register_platform()
    import verl.plugin.platform.platform_manager as pm

    if not isinstance(pm._current_platform, cls):
        set_platform(cls())
    assert get_platform().device_name == "cpu"
    _force_plain_gloo()
    _register_cpu_engine()
    os.environ["VERL_PLATFORM"] = CPU_PLATFORM
    _installed = True
    log.debug("verl CPU platform installed")


def adapt_worker_config_for_cpu(actor_rollout_ref) -> None:
    """Settings verl's defaults get wrong on a CPU, changed in place on an ``actor_rollout_ref``.

    A forward-only (reference) engine uses FSDP2's ``CPUOffloadPolicy(pin_memory=True)``, and
    pinning memory needs an accelerator; on a CPU there is nothing to offload from anyway, so the
    reference engine is built like a training engine (with the actor's optimizer settings; it is
    never stepped).
    """
    from omegaconf import OmegaConf, open_dict

    with open_dict(actor_rollout_ref):
        actor_rollout_ref.ref.fsdp_config.forward_only = False
        actor_rollout_ref.ref.optim = OmegaConf.create(
            OmegaConf.to_container(actor_rollout_ref.actor.optim)
        )
        actor_rollout_ref.actor.fsdp_config.offload_policy = False


def cpu_worker_env() -> dict[str, str]:
    """Environment for Ray workers so that each one installs the CPU platform when verl loads."""
    return {
        "VERL_USE_EXTERNAL_MODULES": __name__,
        "VERL_PLATFORM": CPU_PLATFORM,
        # the engine registry has no "cpu" key in a fresh worker; the "cuda" entry is the same
        # FSDP engine class, and the platform decides where its tensors go
        "VERL_ENGINE_DEVICE": "cuda",
        "TOKENIZERS_PARALLELISM": "false",
    }


# verl imports this module in each Ray worker (VERL_USE_EXTERNAL_MODULES) while `verl` itself is
# still importing; registering the platform then is what makes the worker a CPU worker.
if (
    os.environ.get("VERL_PLATFORM", "").strip().lower() == CPU_PLATFORM
    and "verl" in __import__("sys").modules
):
    _register_platform()
    _force_plain_gloo()
