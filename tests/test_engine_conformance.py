"""``check_engine``: the engine contract checked through the protocol alone, on every engine we
have (hf, synthetic, the SGLang client against the stand-in, token-exact with hf), and broken
engines that each fail with the property named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from selfplay.engines import Generation, SGLangEngineConfig, open_engine
from selfplay.engines.conformance import EngineConformanceError, check_engine
from selfplay.engines.synthetic import SyntheticEngine
from tests.servers import running

TESTS = Path(__file__).resolve().parent

ALL = {"identity", "close-idempotent", "shape", "greedy-reproduces", "seed-reproduces"}
ALL |= {"stop-kept", "concurrent"}


@pytest.fixture(scope="module")
def hf_engine(hf_test_config):
    """A loaded hf engine (on SELFPLAY_TEST_DEVICE, see conftest); each check opens a fresh
    engine object over its weights."""
    return open_engine(hf_test_config)


def _fresh(hf):
    from selfplay.engines.hf import HFEngine

    return lambda: HFEngine(hf.config, model=hf.model, tokenizer=hf.tokenizer)


def _prompt(hf) -> list[int]:
    text = "<|im_start|>user\nWhat is Ava Li's score on BLEU?<|im_end|>\n<|im_start|>assistant\n"
    return hf.tokenizer(text)["input_ids"]


def test_the_hf_engine_keeps_the_contract(hf_engine):
    checked = check_engine(_fresh(hf_engine), _prompt(hf_engine))
    assert set(checked) == ALL | {"too-long"}  # max_context is known: a prompt that fills it


def test_the_synthetic_engine_keeps_the_contract():
    # it answers every request with the same ids: no sampling to tell seeds apart, and its
    # completions are the first max_new_tokens of them (2 here, so that none runs short)
    checked = check_engine(
        lambda: SyntheticEngine([5, 6, 7], latency_s=0.0), [1, 2, 3], sampling=False,
        max_new_tokens=2,
    )  # fmt: skip
    assert set(checked) == ALL  # no max_context: nothing is too long


def test_the_sglang_client_keeps_the_contract_token_exact_with_hf(hf_engine, tiny_model):
    with running([str(TESTS / "sglang_standin.py"), "--model-path", str(tiny_model)]) as url:
        checked = check_engine(
            lambda: open_engine(SGLangEngineConfig(model=str(tiny_model), url=url)),
            _prompt(hf_engine),
            reference=_fresh(hf_engine),
        )
    assert set(checked) >= ALL | {"reference"}


class _Broken(SyntheticEngine):
    """A synthetic engine with one fault."""

    def __init__(self, fault: str) -> None:
        super().__init__([5, 6, 7], latency_s=0.0)
        self.fault, self.closed = fault, 0

    async def generate(self, request):
        gen = await super().generate(request)
        if self.fault == "one-too-many":
            return dataclasses.replace(gen, token_ids=[*gen.token_ids, 9], logprobs=[-1.0] * 3)
        if self.fault == "no-logprobs":
            return dataclasses.replace(gen, logprobs=[])
        if self.fault == "drops-stop" and gen.finish_reason == "stop":
            return Generation(gen.token_ids[:-1], gen.logprobs[:-1], "stop")
        return gen

    async def aclose(self) -> None:
        self.closed += 1
        if self.fault == "closes-once" and self.closed > 1:
            raise RuntimeError("already closed")
        await super().aclose()


@pytest.mark.parametrize(
    ("fault", "prop"),
    [
        ("one-too-many", "shape"),
        ("no-logprobs", "shape"),
        ("drops-stop", "stop-kept"),
        ("closes-once", "close-idempotent"),
    ],
)
def test_a_broken_engine_fails_with_the_property_named(fault, prop):
    with pytest.raises(EngineConformanceError) as err:
        check_engine(lambda: _Broken(fault), [1, 2, 3, 4], sampling=False, max_new_tokens=2)
    assert err.value.prop == prop, str(err.value)
