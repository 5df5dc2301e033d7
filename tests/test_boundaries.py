"""Token ids and log-probs are checked where they enter: an engine's answer (ints in the model's
vocabulary, finite log-probs at most 0, no more tokens than asked for) and a training file (ids
in the model's vocabulary), each refused with a message naming the server or the file."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from selfplay.engines import EngineFailure, Generation, GenerationRequest
from selfplay.engines.answers import check_answer, vocab_size

REQUEST = GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=16)


@pytest.mark.parametrize(
    ("ids", "logprobs", "said"),
    [
        ([5, 61.7], [-0.1, -0.2], "token id 61.7 at position 1"),
        (["63"], [-0.1], "token id '63'"),
        ([True], [-0.1], "token id True"),
        ([-1], [-0.1], "token id -1"),
        ([99], [-0.1], "token id 99 at position 0, not an id of the model (0 to 49)"),
        ([5], [math.nan], "log-prob nan"),
        ([5], [0.5], "log-prob 0.5"),
        ([5] * 17, [-0.1] * 17, "sent 17 tokens for a request of at most 16"),
        ([5, 6], [-0.1], "1 log-probs for 2 token ids"),
    ],
)
def test_an_engine_answer_out_of_bounds_stops_the_run_naming_the_server(ids, logprobs, said):
    gen = Generation(token_ids=ids, logprobs=logprobs, finish_reason="stop")
    with pytest.raises(EngineFailure, match="the sglang server at http://x") as e:
        check_answer(gen, REQUEST, 50, "the sglang server at http://x")
    assert said in str(e.value)


def test_a_good_answer_passes_and_the_vocabulary_comes_from_the_model_config(tiny_model):
    gen = Generation(token_ids=[0, 49], logprobs=[0.0, -3.0], finish_reason="length")
    assert check_answer(gen, REQUEST, 50, "x") is gen
    assert check_answer(Generation([10**6], [-1.0], "stop"), REQUEST, None, "x")  # id unknown
    config = json.loads((tiny_model / "config.json").read_text())
    assert vocab_size(str(tiny_model)) == config["vocab_size"]
    assert vocab_size("Qwen/Qwen2.5-7B-Instruct") is None  # an id only a server resolves


def test_an_attached_engine_sending_ids_outside_the_vocabulary_stops_generate(tiny_model, tmp_path):
    """A server at --engine-url whose /generate sends an id past the model's vocabulary: exit 1
    with one line naming the server and the id, not a tokenizer error deep in a game."""
    from tests.servers import Reply, stub_server

    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    answer = {
        "text": "x",
        "meta_info": {
            "output_token_logprobs": [[-0.5, vocab + 7, None]],
            "completion_tokens": 1,
            "finish_reason": {"type": "stop"},
            "prompt_tokens": 3,
        },
    }
    with stub_server([Reply(body=json.dumps(answer).encode())]) as (url, _):
        cmd = [sys.executable, "-m", "selfplay", "generate", "--engine", "sglang",
               "--engine-url", url, "--model", str(tiny_model), "--out", str(tmp_path / "g"),
               "--num-games", "1", "--table-size", "3"]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    said = " ".join(res.stderr.split())
    assert res.returncode == 1, said[-3000:]
    assert f"the SGLang server at {url} sent token id {vocab + 7}" in said, said[-3000:]
    assert "out of range integral" not in said and "Traceback" not in said


def test_a_training_file_with_ids_outside_the_vocabulary_is_refused_naming_it(tiny_model, tmp_path):
    """train --data with a row whose ids are past the model's vocabulary (another model's file,
    flipped bytes): exit 1 naming the file, the column and the id, before the trainer starts."""
    from transformers import AutoTokenizer

    from selfplay.models import tokenizer_fingerprint
    from tests.fakes import make_rows, simple_specs, write_rows

    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model))
    rows = make_rows(simple_specs(), fingerprint=fp)
    rows[3]["response_ids"] = [*rows[3]["response_ids"][:-1], vocab + 100]
    data = write_rows(tmp_path / "train.parquet", rows)
    cmd = [sys.executable, "-m", "selfplay", "train", "--data", str(data), "--model",
           str(tiny_model), "--out", str(tmp_path / "out")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    said = " ".join(res.stderr.split()) + " ".join(res.stdout.split())
    assert res.returncode == 1, said[-3000:]
    assert f"{data}: column response_ids holds token id {vocab + 100}" in said, said[-3000:]
    assert "IndexError" not in said and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("could not create a primitive"),
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 9663676416 bytes."
        ),
    ],
)
def test_out_of_memory_in_train_says_what_to_lower_and_keeps_nothing(error, tiny_model, tmp_path):
    """A failed allocation while training (oneDNN's 'could not create a primitive', an empty
    MemoryError, torch's allocator): one error naming the options to lower, no half-written
    folder left; any other error passes through unchanged."""
    from selfplay.train.config import TrainConfig
    from selfplay.train.publish import OutOfMemory, publish

    cfg = TrainConfig(data=tmp_path / "t.parquet", model=str(tiny_model), out=tmp_path / "m")

    def run(staged):
        staged.out.mkdir(parents=True)
        (staged.out / "model.safetensors").write_bytes(b"half")
        raise error

    with pytest.raises(OutOfMemory, match="ran out of memory") as e:
        publish(cfg, run)
    assert "--micro-batch-size (now 4)" in str(e.value) and "Nothing was kept" in str(e.value)
    assert not (tmp_path / "m").exists() and not (tmp_path / ".m.partial").exists()

    def other(staged):
        raise RuntimeError("a shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        publish(cfg, other)


def test_a_model_with_custom_code_is_refused_before_training(tiny_model, tmp_path):
    """config.json with auto_map (custom model code, which selfplay never runs): transformers
    cannot save the trained copy's config without that code, so train and sft refuse it before
    any update, naming the file, instead of failing with a TypeError after training."""
    import shutil

    from selfplay.train.config import TrainConfig
    from selfplay.train.publish import CustomCodeModel, publish

    model = tmp_path / "custom"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    cfg = TrainConfig(data=tmp_path / "t.parquet", model=str(model), out=tmp_path / "m")
    ran = []
    with pytest.raises(CustomCodeModel, match="auto_map: AutoModelForCausalLM"):
        publish(cfg, lambda staged: ran.append(staged))
    assert ran == [] and not (tmp_path / "m").exists()


def test_closing_with_paid_partner_answers_in_flight_says_it_waits_and_for_how_long(caplog):
    """Ctrl-C (or the end of a run) while partner answers are in flight: the client waits up to
    drain_s for the answers already paid for, and says so in one warning instead of a silent
    pause; a call that outlasts the wait is cancelled."""
    import asyncio
    import logging

    from selfplay.players.api import ApiPartnerConfig, PartnerClient

    class SlowEngine:
        closed = False

        async def chat(self, messages, **sampling):
            await asyncio.sleep(30)

        async def aclose(self):
            self.closed = True

    async def scenario():
        config = ApiPartnerConfig(model="m", system_prompt="be shy", drain_s=0.2)
        engine = SlowEngine()
        client = PartnerClient(config, engine)
        call = asyncio.ensure_future(client.reply([{"role": "user", "content": "hi"}]))
        await asyncio.sleep(0.05)
        await client.aclose()
        call.cancel()
        return engine.closed

    with caplog.at_level(logging.WARNING, logger="selfplay.players.api"):
        assert asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records]
    assert any("waiting up to 0 s for 1 partner answer(s) already paid for" in m for m in said)
