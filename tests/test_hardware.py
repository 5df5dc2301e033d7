"""The dtype rule (selfplay.hardware): bf16 only where the device computes it natively."""

from __future__ import annotations

import pytest

from selfplay import hardware
from selfplay.engines import HFEngineConfig
from selfplay.train.config import TrainConfig

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
SKYLAKE_X = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512vl avx512_vnni\n"


@pytest.fixture
def cpu(monkeypatch, tmp_path):
    """``cpu(text)``: the probe reads ``text`` as /proc/cpuinfo (None: there is none), with the
    environment's override unset."""

    def use(text: str | None) -> None:
        path = tmp_path / "cpuinfo"
        path.unlink(missing_ok=True)
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(hardware, "CPUINFO", path)
        monkeypatch.delenv(hardware.OVERRIDE_ENV, raising=False)
        monkeypatch.delenv(hardware.ONEDNN_ISA_ENV, raising=False)
        hardware.cpu_has_native_bf16.cache_clear()

    yield use
    hardware.cpu_has_native_bf16.cache_clear()


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [(AVX2_ONLY, "fp32"), (SKYLAKE_X, "fp32"), (SAPPHIRE, "bf16"), (ZEN4, "bf16"), (None, "fp32")],
    ids=["avx2-only", "avx512-without-bf16", "amx", "avx512-bf16", "no-cpuinfo"],
)
def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(cpu, cpuinfo, expected):
    cpu(cpuinfo)
    assert hardware.resolve_dtype("auto", "cpu") == expected
    # the trainer and the hf engine follow the same rule
    train = TrainConfig(data="d.parquet", model="m", out="o")
    assert train.dtype == "auto" and train.param_dtype == expected


@pytest.mark.parametrize(
    ("cap", "expected"),
    [("AVX2", "fp32"), ("avx512_core", "fp32"), ("AVX512_CORE_BF16", "bf16"), ("ALL", "bf16")],
)
def test_a_onednn_isa_cap_below_bf16_picks_fp32(cpu, monkeypatch, cap, expected):
    """oneDNN capped below its bf16 instructions emulates bf16 (an AVX2-only machine's case)."""
    cpu(SAPPHIRE)
    monkeypatch.setenv(hardware.ONEDNN_ISA_ENV, cap)
    assert hardware.resolve_dtype("auto", "cpu") == expected


def test_an_explicit_dtype_wins_over_the_rule(cpu):
    cpu(AVX2_ONLY)
    assert hardware.resolve_dtype("bf16", "cpu") == "bf16"
    cpu(SAPPHIRE)
    assert hardware.resolve_dtype("fp32", "cpu") == "fp32"
    assert hardware.resolve_dtype("float32", "cpu") == "fp32"  # torch's name
    with pytest.raises(ValueError, match="float16"):
        hardware.resolve_dtype("float16", "cpu")


def test_the_environment_overrides_the_probe(cpu, monkeypatch):
    cpu(SAPPHIRE)
    monkeypatch.setenv(hardware.OVERRIDE_ENV, "0")
    hardware.cpu_has_native_bf16.cache_clear()
    assert hardware.resolve_dtype(None, "cpu") == "fp32"
    cpu(AVX2_ONLY)
    monkeypatch.setenv(hardware.OVERRIDE_ENV, "1")
    hardware.cpu_has_native_bf16.cache_clear()
    assert hardware.resolve_dtype("auto", "cpu") == "bf16"


def test_older_names_read_as_the_rule_or_its_dtype():
    """Manifests and configs of older runs stored None (the rule) or torch's names."""
    assert TrainConfig(data="d", model="m", out="o", dtype=None).dtype == "auto"
    assert HFEngineConfig(model="m", dtype="bfloat16").dtype == "bf16"
    assert HFEngineConfig(model="m", dtype="float32").dtype == "fp32"
    with pytest.raises(ValueError):
        HFEngineConfig(model="m", dtype="float16")


def test_the_hf_engine_loads_in_the_dtype_the_rule_picks(cpu, tiny_model):
    import torch

    from selfplay.engines.hf import HFEngine

    cpu(AVX2_ONLY)
    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu"))
    assert engine.dtype == "fp32" and next(engine.model.parameters()).dtype == torch.float32
    cpu(SAPPHIRE)
    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu"))
    assert engine.dtype == "bf16" and next(engine.model.parameters()).dtype == torch.bfloat16


def test_this_machine_is_read():
    """The real /proc/cpuinfo parses (where there is one): its flags include the basics."""
    flags = hardware.cpu_flags()
    if hardware.CPUINFO.exists():
        assert {"sse2", "fp", "fpu"} & flags  # x86 or Arm
