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


def test_the_hf_engine_loads_in_the_dtype_the_rule_picks(cpu, tiny_model, monkeypatch, tmp_path):
    """On a CPU without native bf16, fp32 and nothing measured; on one with it (auto), the
    faster of the two as measured, kept per CPU and model shape so that the next engine reads
    it; an explicit dtype is never measured."""
    import orjson
    import torch

    from selfplay.engines import hf_dtype
    from selfplay.engines.hf import HFEngine

    monkeypatch.setenv("SELFPLAY_CACHE", str(tmp_path / "cache"))
    timings: list[dict] = []

    def measured(build):
        assert timings, "measured where the verdict was kept or no measurement was due"
        return timings.pop()

    monkeypatch.setattr(hf_dtype, "measure", measured)
    cpu(AVX2_ONLY)
    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu"))
    assert engine.dtype == "fp32" and next(engine.model.parameters()).dtype == torch.float32
    cpu(SAPPHIRE)
    timings.append({"fp32": 1.0, "bf16": 0.5})
    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu"))
    assert engine.dtype == "bf16" and next(engine.model.parameters()).dtype == torch.bfloat16
    kept = orjson.loads(hf_dtype.choices_path().read_bytes())
    assert [v["dtype"] for v in kept.values()] == ["bf16"]
    assert [v["seconds"] for v in kept.values()] == [{"fp32": 1.0, "bf16": 0.5}]
    assert HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu")).dtype == "bf16"  # kept
    explicit = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu", dtype="fp32"))
    assert explicit.dtype == "fp32"
    # another thread count is another verdict; bf16 within the margin of fp32 is not chosen
    timings.append({"fp32": 1.0, "bf16": 0.97})
    more = hardware.usable_cores() + 1
    one = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu", cpu_threads=more))
    assert one.dtype == "fp32" and len(orjson.loads(hf_dtype.choices_path().read_bytes())) == 2
    assert not timings
    # the engine's paths changed (a release's): its verdicts are measured again
    monkeypatch.setattr(hf_dtype, "ENGINE_PATHS", hf_dtype.ENGINE_PATHS + 1)
    timings.append({"fp32": 1.0, "bf16": 1.5})
    assert HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu")).dtype == "fp32"
    assert not timings and len(orjson.loads(hf_dtype.choices_path().read_bytes())) == 3
    # a verdict that is not a dtype is measured again
    kept = orjson.loads(hf_dtype.choices_path().read_bytes())
    hf_dtype.choices_path().write_bytes(orjson.dumps({k: {"dtype": "fp16"} for k in kept}))
    timings.append({"fp32": 1.0, "bf16": 0.5})
    assert HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu")).dtype == "bf16"
    assert not timings
    # a verdict file that is a link: measured, used, not written through the link
    linked = tmp_path / "linked"
    linked.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    (linked / hf_dtype.CHOICES_FILE).symlink_to(target)
    monkeypatch.setenv("SELFPLAY_CACHE", str(linked))
    timings.append({"fp32": 1.0, "bf16": 0.5})
    assert HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu")).dtype == "bf16"
    assert target.read_text() == "{}" and not timings
    # a measurement that fails: the flags' rule, nothing kept
    monkeypatch.setenv("SELFPLAY_CACHE", str(tmp_path / "failed"))

    def fails(build):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(hf_dtype, "measure", fails)
    assert HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu")).dtype == "bf16"
    assert not hf_dtype.choices_path().exists()
    monkeypatch.setattr(hf_dtype, "measure", measured)
    # no memory for two more copies of the model: the flags' rule, nothing measured
    monkeypatch.setenv("SELFPLAY_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(hf_dtype, "available_memory", lambda device: 1)
    assert HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu")).dtype == "bf16"
    assert not hf_dtype.choices_path().exists()


def test_the_engines_dtype_measurement_times_both_dtypes_through_the_engine(
    cpu, tiny_model, monkeypatch, tmp_path
):
    """The real measurement (no stand-in): a batch through an engine of each dtype, timed; the
    verdict follows the margin rule, and an unreadable verdict file is measured again."""
    import orjson

    from selfplay.engines import hf_dtype
    from selfplay.engines.hf import HFEngine

    monkeypatch.setenv("SELFPLAY_CACHE", str(tmp_path))
    monkeypatch.setattr(hf_dtype, "ROUNDS", 1)
    built: list[str] = []
    real = hf_dtype.measure
    monkeypatch.setattr(
        hf_dtype, "measure", lambda build: real(lambda d: built.append(d) or build(d))
    )
    cpu(ZEN4)
    hf_dtype.choices_path().write_text("not json")
    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu"))
    assert sorted(built) == ["bf16", "fp32"]
    (verdict,) = orjson.loads(hf_dtype.choices_path().read_bytes()).values()
    seconds = verdict["seconds"]
    assert seconds["fp32"] > 0 and seconds["bf16"] > 0
    faster = "bf16" if seconds["bf16"] < hf_dtype.MARGIN * seconds["fp32"] else "fp32"
    assert engine.dtype == verdict["dtype"] == faster


def test_the_cpus_name_is_read(cpu):
    cpu("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2\n")
    assert hardware.cpu_name() == "AMD EPYC 9B14" and "avx2" in hardware.cpu_flags()
    cpu(AVX2_ONLY)
    assert hardware.cpu_name() == "unknown"
    cpu(None)
    assert hardware.cpu_name() == "unknown" and hardware.cpu_flags() == frozenset()


def test_this_machine_is_read():
    """The real /proc/cpuinfo parses (where there is one): its flags include the basics."""
    flags = hardware.cpu_flags()
    if hardware.CPUINFO.exists():
        assert {"sse2", "fp", "fpu"} & flags  # x86 or Arm
