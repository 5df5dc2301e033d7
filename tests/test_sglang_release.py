"""The SGLang client and its stand-in against the released SGLang (the version pinned in
scripts/setup_sglang_check.sh), without a GPU.

The released package lives in a side venv (scripts/setup_sglang_check.sh builds it once; the
test skips, saying why, only when it cannot be installed). tests/sglang_release_check.py runs
there, once, with every case batched:

(a) every launch command the engine builds (``SGLangEngine.command()``, varied over port, host,
    tp size, memory fraction and extra flags) parses with sglang's ``prepare_server_args``, into
    the ServerArgs we meant;
(b) every request the client sent (recorded off the wire while it runs against the stand-in:
    health, model info, the probe, generations with and without seed, stop ids and top-p, a
    weight reload) is sent again to sglang's released HTTP app in front of its released
    tokenizer manager (only the GPU scheduler is faked: it answers with the stand-in's tokens),
    which must accept it and understand what we meant (its ``GenerateReqInput``,
    ``SamplingParams`` after ``normalize``/``verify``, what reaches the scheduler,
    ``UpdateWeightFromDiskReqInput``);
(c) the stand-in's answers (to those requests and to refused ones: an unknown or mistyped
    sampling key, a prompt too long for the context, no prompt) equal the released server's:
    status, content type, keys, finish reasons, log-prob triples, error bodies, /model_info,
    /v1/models, the reload answer;
(d) the client reads the released answers as it reads the stand-in's, and learns the context
    length where the released server gives it.

The router (sglang-router) is another package and is not checked here.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from selfplay.engines import GenerationRequest, SGLangEngineConfig
from selfplay.engines.sglang import SGLangEngine
from tests.servers import running
from tests.sglang_standin import SAMPLING_KEYS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TIMING = {"id", "e2e_latency", "response_sent_to_client_ts"}  # per-request values
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
EOS = 2

# (config fields, the ServerArgs fields they must set besides the model path)
LAUNCHES = [
    ({}, {"host": "127.0.0.1", "port": 30000, "tp_size": 1, "mem_fraction_static": None}),
    ({"port": 31234, "tp_size": 2}, {"port": 31234, "tp_size": 2}),
    ({"mem_fraction": 0.85}, {"mem_fraction_static": 0.85}),
    ({"host": "0.0.0.0", "extra_args": ("--dp-size=8",)}, {"host": "0.0.0.0", "dp_size": 8}),
    (
        {"extra_args": ("--random-seed", "1", "--context-length", "4096")},
        {"random_seed": 1, "context_length": 4096},
    ),
]


@pytest.fixture(scope="module")
def checker(tiny_model, tmp_path_factory):
    """The release checker, started now (importing sglang and building its front end take
    seconds) and fed later. Its temporary files (sglang's IPC sockets) stay in a test folder."""
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_sglang_check.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    tail = "\n".join(r.stderr.strip().splitlines()[-15:])
    if r.returncode == 3:
        reason = f"the released sglang cannot be installed here:\n{tail}"
        print(reason)
        pytest.skip(reason)
    assert r.returncode == 0, f"scripts/setup_sglang_check.sh failed:\n{tail}"
    python = ROOT / r.stdout.strip().splitlines()[-1]  # an absolute path stays as it is
    proc = subprocess.Popen(
        [str(python), str(TESTS / "sglang_release_check.py"), "--model", str(tiny_model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("sglang_tmp"))},
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _record(log: list[dict], request: httpx.Request, response: httpx.Response) -> None:
    entry: dict = {"method": request.method, "path": request.url.path}
    if request.content:
        entry["body"] = json.loads(request.content)
    answer: dict = {"status": response.status_code}
    answer["content_type"] = response.headers.get("content-type")
    try:
        answer["json"] = response.json()
    except ValueError:
        answer["text"] = response.text
    entry["standin"] = answer
    log.append(entry)


@pytest.fixture(scope="module")
def traffic(tiny_model, tmp_path_factory):
    """The client's requests to the stand-in and its answers (recorded off the wire), then the
    refused requests sent by hand; with what the client meant and what it read."""
    log: list[dict] = []
    send = httpx.AsyncClient.send

    async def recording_send(self, request, **kwargs):
        response = await send(self, request, **kwargs)
        if kwargs.get("stream"):  # the client reads its answers as streams (engines.bounded)
            await response.aread()  # read here to record it; the client then reads it again
        _record(log, request, response)
        return response

    new_weights = str(tmp_path_factory.mktemp("weights") / "round_1")
    meant: list[GenerationRequest] = []
    with running([str(TESTS / "sglang_standin.py"), "--model-path", str(tiny_model)]) as url:
        engine = SGLangEngine(SGLangEngineConfig(model=str(tiny_model), url=url))
        payload = engine.payload
        engine.payload = lambda r: (meant.append(r), payload(r))[1]

        async def client_run():
            generations = []
            await engine.start()
            greedy = GenerationRequest(PROMPT, max_new_tokens=6, temperature=0.0)
            generations.append(await engine.generate(greedy))
            first = generations[0].token_ids[0]
            for request in (
                GenerationRequest(PROMPT, 12, 0.7, seed=1, stop_token_ids=(EOS, 3)),
                GenerationRequest(PROMPT, 3, 1.0, top_p=0.9, seed=2),
                GenerationRequest(PROMPT, 5, 0.0, seed=3, stop_token_ids=(first,)),
            ):
                generations.append(await engine.generate(request))
            reload = getattr(engine, "load_weights", None) or engine.update_weights_from_disk
            await reload(new_weights)
            await engine.aclose()
            return generations

        httpx.AsyncClient.send = recording_send
        try:
            generations = asyncio.run(client_run())
        finally:
            httpx.AsyncClient.send = send
        client_log = list(log)
        by_hand = [
            ("GET", "/model_info", None),
            ("GET", "/get_model_info", None),
            ("GET", "/v1/models", None),
            ("POST", "/flush_cache", None),
            ("POST", "/generate", _body([1, 2, 3], {"max_new_tokens": 4, "no_such_key": 1})),
            ("POST", "/generate", _body([1, 2, 3], {"max_new_tokens": 4.0})),
            ("POST", "/generate", _body([1, 2, 3], {"stop_token_ids": [2.5]})),
            ("POST", "/generate", _body([1, 2, 3], {"temperature": "hot"})),
            ("POST", "/generate", _body([1, 2, 3], {"max_new_tokens": 9000})),
            ("POST", "/generate", _body([5] * 8192, {"max_new_tokens": 1})),
            ("POST", "/generate", _body([], {"max_new_tokens": 1})),
        ]
        with httpx.Client(base_url=url, timeout=120) as http:
            for method, path, body in by_hand:
                r = http.request(method, path, json=body)
                _record(log, r.request, r)
    return {
        "client": client_log,
        "all": log,
        "meant": meant,
        "generations": generations,
        "engine": engine,
        "new_weights": new_weights,
    }


def _body(ids: list[int], params: dict) -> dict:
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True}


@pytest.fixture(scope="module")
def release(checker, traffic, tiny_model):
    """The release checker's answer for every launch command and every recorded exchange."""
    commands = []
    for fields, _ in LAUNCHES:
        config = SGLangEngineConfig(model=str(tiny_model), url="http://127.0.0.1:9", **fields)
        commands.append(SGLangEngine(config).command())  # attached: nothing is launched
    job = {
        "model": str(tiny_model),
        "launch": [cmd[3:] for cmd in commands],
        "exchanges": traffic["all"],
    }
    out, err = checker.communicate(json.dumps(job), timeout=600)
    assert checker.returncode == 0, f"the release checker failed:\n{err[-3000:]}"
    answer = json.loads(out)
    answer["commands"] = commands
    return answer


def _pairs(traffic, release, path: str | None = None, client_only: bool = False):
    exchanges = traffic["client"] if client_only else traffic["all"]
    for ex, got in zip(exchanges, release["exchanges"]):
        if path is None or ex["path"] == path:
            yield ex, got


# -- (a) launch commands --------------------------------------------------------------------


def test_launch_commands_parse_with_the_released_server_args(release, tiny_model):
    assert release["reference"]["launch_module"], "sglang.launch_server is not in the release"
    for cmd, parsed, (_, expected) in zip(release["commands"], release["launch"], LAUNCHES):
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        assert parsed["ok"], f"{cmd}: {parsed['error']}"
        got = parsed["fields"]
        assert got["model_path"] == str(tiny_model), cmd
        for name, value in expected.items():
            assert got[name] == value, f"{cmd}: {name} is {got[name]!r}, meant {value!r}"


# -- (b) request bodies ---------------------------------------------------------------------


def test_generate_bodies_are_what_the_released_server_understands(traffic, release):
    reference = release["reference"]
    generates = list(_pairs(traffic, release, "/generate", client_only=True))
    assert len(generates) == len(traffic["meant"]) == 5  # the probe and four generations
    for (ex, got), meant in zip(generates, traffic["meant"]):
        body = ex["body"]
        assert got["status"] == 200, got
        assert got["request_contract"] is None
        assert set(body) <= set(reference["generate_request_keys"])
        assert set(body["sampling_params"]) <= set(reference["sampling_params_keys"])
        parsed = got["parsed"]
        assert "error" not in parsed, parsed
        assert parsed["request"] == {
            "is_single": True,
            "input_ids": list(meant.prompt_ids),
            "return_logprob": True,
            "logprob_start_len": -1,  # output log-probs only
            "stream": False,
        }
        want = {
            "max_new_tokens": meant.max_new_tokens,
            "temperature": meant.temperature if meant.temperature > 0 else 1.0,
            "top_p": meant.top_p,
            "top_k": 1 if meant.temperature == 0 else 1 << 30,  # greedy is top-k 1 there
            "stop_token_ids": sorted(meant.stop_token_ids) or None,
            "sampling_seed": meant.seed,
        }
        assert parsed["sampling"] == {**want, "ignore_eos": False}
        # and what reached the (faked) scheduler
        assert parsed["dispatched"]["input_ids"] == list(meant.prompt_ids)
        assert parsed["dispatched"]["return_logprob"] is True
        assert parsed["dispatched"]["sampling"] == {**want, "ignore_eos": False}


def test_the_reload_body_is_what_the_released_server_understands(traffic, release):
    (ex, got), *more = list(_pairs(traffic, release, "/update_weights_from_disk"))
    assert not more
    assert set(ex["body"]) <= set(release["reference"]["update_weights_keys"])  # none ignored
    assert got["status"] == 200, got
    request = got["parsed"]["request"]
    assert request["model_path"] == traffic["new_weights"]
    assert request["flush_cache"] is True
    assert request["abort_all_requests"] is False


# -- (c) the stand-in answers as the released server does -------------------------------------


def test_the_standin_sampling_keys_are_the_released_ones(release):
    assert list(SAMPLING_KEYS) == release["reference"]["sampling_params_keys"]


def test_the_standin_answers_as_the_released_server(traffic, release):
    problems = []  # all of them, not just the first

    def differ(where: str, what: str, ours, theirs) -> None:
        if ours != theirs:
            problems.append(f"{where}: {what}: stand-in {ours!r:.300}, released {theirs!r:.300}")

    compared = set()
    for ex, got in _pairs(traffic, release):
        mine, where = ex["standin"], f"{ex['method']} {ex['path']} {ex.get('body', '')}"[:120]
        compared.add(ex["path"])
        differ(where, "status", mine["status"], got["status"])
        is_json = [str(a.get("content_type")).startswith("application/json") for a in (mine, got)]
        differ(where, "JSON answer", is_json[0], is_json[1])
        if "json" not in got or "json" not in mine:
            differ(where, "body", mine.get("text"), got.get("text"))
            continue
        ours, theirs = mine["json"], got["json"]
        if ex["path"] == "/generate" and got["status"] == 200:
            differ(where, "JSON contract error", got.get("standin_contract"), None)
            differ(where, "keys", sorted(ours), sorted(theirs))
            meta, real = ours.get("meta_info", {}), theirs["meta_info"]
            differ(where, "meta_info keys", sorted(meta), sorted(real))
            for key, value in real.items():
                if key not in TIMING and key in meta:
                    differ(where, f"meta_info.{key}", meta[key], value)
            differ(where, "output_ids", ours.get("output_ids"), theirs["output_ids"])
        elif ex["path"] in ("/model_info", "/get_model_info"):
            theirs = {k: v for k, v in theirs.items() if k != "embedding"}  # the embedding plan
            differ(where, "keys", sorted(ours), sorted(theirs))
            for key, value in theirs.items():
                differ(where, key, ours.get(key), value)
        elif ex["path"] == "/v1/models":
            for card in (*ours.get("data", []), *theirs["data"]):
                card.pop("created", None)
            differ(where, "model list", ours, theirs)
        else:  # error bodies, the reload answer, 404s
            differ(where, "body", ours, theirs)
    assert not problems, "\n".join(problems)
    assert compared >= {"/health", "/model_info", "/generate", "/update_weights_from_disk"}


# -- (d) the client with the released answers -------------------------------------------------


def test_the_client_reads_the_released_answers_as_the_standins(traffic, release):
    generates = [got for _, got in _pairs(traffic, release, "/generate", client_only=True)]
    for got, gen in zip(generates[1:], traffic["generations"]):  # [0] is the probe
        read = SGLangEngine.parse(got["json"], len(PROMPT))
        assert (read.token_ids, read.logprobs, read.finish_reason) == (
            gen.token_ids,
            gen.logprobs,
            gen.finish_reason,
        )
    assert {g.finish_reason for g in traffic["generations"]} == {"stop", "length"}


def test_the_client_learns_the_context_length_from_the_released_server(traffic, release):
    """The released server does not put the context length in /model_info; /v1/models has it
    (max_model_len). Fails until SGLangEngine.read_model_info reads it there."""
    models = [got for ex, got in _pairs(traffic, release, "/v1/models")]
    assert models[0]["json"]["data"][0]["max_model_len"] == release["context_len"]
    assert traffic["engine"].max_context == release["context_len"]
