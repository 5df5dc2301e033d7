"""Replay selfplay's SGLang traffic into a released sglang; run by the side venv's Python.

tests/test_sglang_release.py runs this with the Python of the venv that
scripts/setup_sglang_check.sh builds (sglang pinned there, installed without its GPU
dependencies), once: ``python sglang_release_check.py [--model DIR]``, with every case in one
JSON object on stdin; the answer is one JSON object on stdout. With ``--model`` the released
front end is built before stdin is read (so the caller can start this early); else from the
job's ``model``. ``--import-only`` just imports the release. Nothing here imports selfplay: this
file only knows the released sglang.

What it does with the input:

- ``launch``: each argv (a launch command without ``python -m sglang.launch_server``) is
  parsed by ``sglang.srt.server_args.prepare_server_args``, as ``sglang.launch_server`` does
  first; the answer holds the parsed ServerArgs fields (or the error).
- ``exchanges``: each HTTP request our client (or the test) sent to the stand-in is sent again
  to the released HTTP app (``sglang.srt.entrypoints.http_server.app``) in front of a released
  ``TokenizerManager`` for ``model`` (the tiny test model, on CPU). Only the GPU side is faked:
  where the tokenizer manager hands a request to the scheduler, a fake scheduler answers with
  the tokens the stand-in generated for it (its ids, log-probs, finish and text), so everything
  the client sees (request parsing and validation, the JSON contract gate, ``meta_info``,
  finish reasons, log-prob triples, error bodies, /model_info, /v1/models, reload answers) is
  built by the released code. For each request the answer gives the released status,
  content type and body, plus what the released code parsed out of it (the normalised
  ``GenerateReqInput`` and ``SamplingParams`` after ``normalize()`` / ``verify()``, the
  ``UpdateWeightFromDiskReqInput``).
- ``reference``: field names read from the released package (the generated JSON contract
  ``sglang.api.v1.api_types``, the request structs).

The released package imports ``torchvision`` at import time (multimodal helpers); the CPU
torch here has no matching torchvision, so an empty stand-in module is put in its place (no
code used here touches it).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import logging
import os
import sys
import types
import warnings
from array import array

# The released /health runs a 1-token generation unless this is off; both ways a healthy
# server answers 200 with an empty body (http_server.py, health_generate).
os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def _stub_torchvision() -> None:
    try:
        import torchvision  # noqa: F401

        return
    except Exception:  # absent, or built for another torch
        sys.modules.pop("torchvision", None)
    # transformers decides once whether torchvision is there: let it see that it is not
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()

    class _Anything:
        def __init__(self, name: str) -> None:
            self._name = name

        def __getattr__(self, name: str) -> _Anything:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything(f"{self._name}.{name}")

        def __call__(self, *args, **kwargs) -> _Anything:
            return _Anything(f"{self._name}()")

    class _Module(types.ModuleType):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything(f"{self.__name__}.{name}")

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname == "torchvision" or fullname.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            return _Module(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    sys.meta_path.insert(0, _Finder())


def _import_release():
    _stub_torchvision()
    with contextlib.redirect_stdout(io.StringIO()):
        import sglang
        from sglang.api.v1 import api_types
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers import io_struct, schedule_batch, tokenizer_manager
        from sglang.srt.sampling import sampling_params
        from sglang.srt.server_args import prepare_server_args
    return types.SimpleNamespace(
        version=sglang.__version__,
        http_server=http_server,
        io_struct=io_struct,
        schedule_batch=schedule_batch,
        tokenizer_manager=tokenizer_manager,
        sampling_params=sampling_params,
        prepare_server_args=prepare_server_args,
        api=api_types,
    )


# the ServerArgs fields a launch command sets (the test compares them with what it meant)
LAUNCH_FIELDS = (
    "model_path", "host", "port", "tp_size", "mem_fraction_static", "dp_size", "random_seed",
    "context_length", "served_model_name", "tokenizer_path",
)  # fmt: skip
# the SamplingParams fields reported after normalize() and verify()
SAMPLING_FIELDS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed",
    "ignore_eos",
)  # fmt: skip


def check_launch(rel, argv: list[str]) -> dict:
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = rel.prepare_server_args(list(argv))
    except SystemExit as e:  # argparse refuses: unknown flag, bad value
        return {"ok": False, "error": f"argparse exit {e.code}"}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "fields": {f: getattr(args, f, None) for f in LAUNCH_FIELDS}}


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, array):
        return list(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class FrontEnd:
    """The released HTTP app and tokenizer manager for ``model``, with a fake scheduler."""

    def __init__(self, rel, model: str) -> None:
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import PortArgs

        self.rel = rel
        with contextlib.redirect_stdout(io.StringIO()):
            server_args = rel.prepare_server_args(["--model-path", model, "--device", "cpu"])
            server_args.resolve_once()
            publish(server_args, role="tokenizer")
            tm = rel.tokenizer_manager.TokenizerManager(server_args, PortArgs.init_new(server_args))
        tm.server_status = rel.tokenizer_manager.ServerStatus.Up  # as after the warm-up request
        tm._dispatch_to_scheduler = self._scheduler

        async def flush_cache(timeout_s: float = 0.0):  # a scheduler round trip, faked
            return rel.io_struct.FlushCacheReqOutput(success=True)

        tm.flush_cache = flush_cache
        self.tm = tm
        hs = rel.http_server
        hs.set_global_state(
            hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={})
        )
        self.app = hs.app
        self.outcome: dict | None = None  # what the fake scheduler answers to the next request
        self.seen: list = []  # what reached the scheduler

    # the fake scheduler (and detokenizer): the tokenizer manager's only contact with the GPU
    def _scheduler(self, obj) -> None:
        io_struct = self.rel.io_struct
        self.seen.append(obj)
        if isinstance(obj, io_struct.UpdateWeightFromDiskReqInput):
            result = io_struct.UpdateWeightFromDiskReqOutput(
                success=True, message="Succeeded to update model weights.", num_paused_requests=0
            )
            self.tm.model_update_result.set_result(result)
        elif isinstance(obj, io_struct.TokenizedGenerateReqInput):
            out = self._batch_output(obj)
            asyncio.get_running_loop().call_soon(
                lambda: asyncio.ensure_future(self.tm._handle_batch_output(out))
            )

    def _batch_output(self, req):
        sb = self.rel.schedule_batch
        o = self.outcome or {"ids": [0], "logprobs": [0.0], "finish": "length", "text": ""}
        ids, n = list(o["ids"]), len(o["ids"])
        if o["finish"] == "stop":
            finish = sb.FINISH_MATCHED_TOKEN(matched=ids[-1]).to_json()
        else:
            finish = sb.FINISH_LENGTH(length=n).to_json()
        none = [None]
        return self.rel.io_struct.BatchStrOutput(
            rids=[req.rid],
            finished_reasons=[finish],
            output_strs=[o["text"]],
            output_ids=[array("q", ids)],
            prompt_tokens=[len(req.input_ids)],
            completion_tokens=[n],
            reasoning_tokens=[0],
            cached_tokens=[0],
            input_token_logprobs_val=[[]],
            input_token_logprobs_idx=[[]],
            output_token_logprobs_val=[list(o["logprobs"])],
            output_token_logprobs_idx=[ids],
            input_top_logprobs_val=[[]],
            input_top_logprobs_idx=[[]],
            output_top_logprobs_val=[[]],
            output_top_logprobs_idx=[[]],
            input_token_ids_logprobs_val=[[]],
            input_token_ids_logprobs_idx=[[]],
            output_token_ids_logprobs_val=[[]],
            output_token_ids_logprobs_idx=[[]],
            output_token_entropy_val=none,
            output_token_sampling_mask=None,
            output_hidden_states=None,
            routed_experts=None,
            indexer_topk=None,
            placeholder_tokens_idx=None,
            placeholder_tokens_val=None,
            retraction_counts=[0],
        )

    async def exchange(self, ex: dict) -> dict:
        self.outcome = _outcome(ex.get("standin"))
        self.seen.clear()
        body = None if ex["method"] == "GET" else json.dumps(ex.get("body")).encode()
        status, headers, data = await asgi_request(self.app, ex["method"], ex["path"], body)
        answer = {"status": status, "content_type": headers.get("content-type")}
        try:
            answer["json"] = json.loads(data)
        except ValueError:
            answer["text"] = data.decode("utf-8", "replace")
        parsed = self._parsed(ex)
        if parsed:
            answer["parsed"] = parsed
        return answer

    def _parsed(self, ex: dict) -> dict:
        """What the released code made of the request body (before and at the scheduler)."""
        io_struct, sp = self.rel.io_struct, self.rel.sampling_params
        if ex["path"] == "/generate":
            out: dict = {}
            try:
                obj = io_struct.GenerateReqInput(**ex["body"])
                obj.normalize_batch_and_arguments()
                out["request"] = {
                    "is_single": obj.is_single,
                    "input_ids": obj.input_ids,
                    "return_logprob": obj.return_logprob,
                    "logprob_start_len": obj.logprob_start_len,
                    "stream": obj.stream,
                }
                params = sp.SamplingParams(**obj.sampling_params)
                params.normalize(None)
                params.verify(self.tm.model_config.vocab_size)
                out["sampling"] = {f: _jsonable(getattr(params, f)) for f in SAMPLING_FIELDS}
            except Exception as e:
                out["error"] = f"{type(e).__name__}: {e}"
            tokenized = [o for o in self.seen if isinstance(o, io_struct.TokenizedGenerateReqInput)]
            if tokenized:
                t = tokenized[0]
                out["dispatched"] = {
                    "input_ids": list(t.input_ids),
                    "return_logprob": t.return_logprob,
                    "sampling": {
                        f: _jsonable(getattr(t.sampling_params, f)) for f in SAMPLING_FIELDS
                    },
                }
            return out
        if ex["path"] == "/update_weights_from_disk":
            sent = [o for o in self.seen if isinstance(o, io_struct.UpdateWeightFromDiskReqInput)]
            if not sent:
                return {}
            return {
                "request": {
                    f: _jsonable(getattr(sent[0], f))
                    for f in io_struct.UpdateWeightFromDiskReqInput.__struct_fields__
                }
            }
        return {}


async def asgi_request(app, method: str, path: str, body: bytes | None):
    """One HTTP request straight into an ASGI app, in this event loop (no server, no lifespan:
    the tokenizer manager's loop and locks stay in one loop)."""
    headers = [(b"host", b"127.0.0.1")]
    if body is not None:
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 30000), "state": {},
    }  # fmt: skip
    done = asyncio.Event()
    sent_body = False
    start: dict = {}
    chunks: list[bytes] = []

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body or b"", "more_body": False}
        await done.wait()  # the client stays connected until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=60)
    done.set()
    hdrs = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    return start.get("status"), hdrs, b"".join(chunks)


def _outcome(standin: dict | None) -> dict | None:
    """The tokens the stand-in generated (for the fake scheduler to answer with)."""
    if not standin or not isinstance(standin.get("json"), dict):
        return None
    data = standin["json"]
    meta = data.get("meta_info") or {}
    triples = meta.get("output_token_logprobs") or []
    ids = data.get("output_ids") or [t[1] for t in triples]
    finish = meta.get("finish_reason") or {}
    return {
        "ids": [int(i) for i in ids],
        "logprobs": [float(t[0]) if t[0] is not None else 0.0 for t in triples],
        "finish": finish.get("type", "length") if isinstance(finish, dict) else "length",
        "text": data.get("text") or "",
    }


def contract(rel, kind: str, value) -> str | None:
    """The generated JSON contract's judgment of a value (None: accepted)."""
    api = rel.api
    decode = {
        "generate_response": api.GenerateResponse.from_json_value,
        "model_info": api.GetModelInfoResponse.from_json_value,
        "generate_request": api.GenerateRequest.from_json_value,
    }[kind]
    try:
        decoded = decode(value)
    except api.JsonContractError as e:
        return str(e)
    if kind == "generate_response" and decoded.meta_info is not None:
        finish = decoded.meta_info.finish_reason
        if finish is not None and isinstance(finish, dict):  # no known finish shape matched
            return f"finish_reason {finish!r} is none of stop/length/abort"
    return None


def reference(rel) -> dict:
    api, io_struct = rel.api, rel.io_struct
    return {
        "version": rel.version,
        "launch_module": importlib.util.find_spec("sglang.launch_server") is not None,
        "sampling_params_keys": list(api.SamplingParams.__struct_fields__),
        "generate_request_keys": [
            f.name for f in __import__("dataclasses").fields(io_struct.GenerateReqInput)
        ],
        "update_weights_keys": list(io_struct.UpdateWeightFromDiskReqInput.__struct_fields__),
        "update_weights_answer_keys": list(
            io_struct.UpdateWeightFromDiskReqOutput.__struct_fields__
        ),
        "meta_info_contract_keys": list(api.GenerateMetaInfo.__struct_fields__),
        "model_info_contract_keys": list(api.GetModelInfoResponse.__struct_fields__),
    }


def main() -> None:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # the released code prints; only the answer goes to stdout
    rel = _import_release()
    if "--import-only" in sys.argv:  # the setup script's check that the release imports
        real_stdout.write(f"sglang {rel.version} imports\n")
        return
    # the front end is built before the job is read: the caller starts this early, with the
    # model on the command line, and sends the job when its traffic is recorded
    model = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else None
    front = FrontEnd(rel, model) if model else None
    job = json.loads(sys.stdin.read())
    answer: dict = {"reference": reference(rel)}
    answer["launch"] = [check_launch(rel, argv) for argv in job.get("launch", [])]
    front = front or FrontEnd(rel, job["model"])
    answer["context_len"] = front.tm.context_len
    answer["exchanges"] = asyncio.run(_exchanges(rel, front, job.get("exchanges", [])))
    real_stdout.write(json.dumps(answer, default=repr))
    real_stdout.flush()
    os._exit(0)  # the tokenizer manager's loop and sockets need no orderly shutdown


async def _exchanges(rel, front: FrontEnd, exchanges: list[dict]) -> list[dict]:
    answers = []
    for ex in exchanges:
        got = await front.exchange(ex)
        standin = ex.get("standin") or {}
        if isinstance(standin.get("json"), dict) and ex["path"] == "/generate":
            got["standin_contract"] = contract(rel, "generate_response", standin["json"])
        if isinstance(standin.get("json"), dict) and ex["path"] in ("/model_info",):
            got["standin_contract"] = contract(rel, "model_info", standin["json"])
        if ex["path"] == "/generate" and isinstance(ex.get("body"), dict):
            got["request_contract"] = contract(rel, "generate_request", ex["body"])
        answers.append(got)
    return answers


if __name__ == "__main__":
    main()
