"""A local stand-in for an SGLang server: SGLang's HTTP wire format, backed by the hf engine.

Used where no GPU (and so no SGLang) is available. It answers as SGLang 0.5.23's HTTP server
does (tests/test_sglang_release.py replays the same requests into the released server code and
compares the answers) for the parts the client uses:

- GET /health: 200, empty body.
- GET /model_info (and the deprecated /get_model_info): the model's path, served name, type and
  architectures, weight version...; no context length (SGLang does not put it there).
- GET /v1/models: the OpenAI model list; ``max_model_len`` is the context length.
- POST /generate: ``input_ids`` (one or a batch); ``sampling_params`` checked like SGLang's
  JSON contract (an unknown key or a wrongly typed one is HTTP 400 ``{"error": "..."}``); a
  prompt that reaches the context length, or prompt + ``max_new_tokens`` beyond it, is HTTP 400
  ``{"error": {"message": ...}}`` (SGLang refuses both; it does not shorten the completion);
  ``return_logprob`` -> ``meta_info.output_token_logprobs`` as [[logprob, token_id, null], ...],
  the stop token included; ``finish_reason`` {"type": "stop", "matched": id} or
  {"type": "length", "length": n}; the other ``meta_info`` keys SGLang sends.
- POST /update_weights_from_disk: {"success", "message", "num_paused_requests"}; the new path
  becomes the model path and served name (the weights are not reloaded: the hf engine keeps
  the model it started with).
- GET/POST /flush_cache: 200 with SGLang's plain-text message.

Concurrent requests are batched by the hf engine.

It accepts SGLang's launch flags (--model-path, --host, --port, --tp-size, ...; unknown ones are
ignored) plus test hooks: --die-after N (the process exits with code 1 on request N+1, as a crashed
server would), --pid-file PATH, --latency S (extra seconds per request).

``install_fake_sglang(dir)`` writes a package ``sglang`` with a ``launch_server`` module that runs
this file, so ``python -m sglang.launch_server ...`` starts the stand-in when ``dir`` is on
PYTHONPATH: the client's launch path is then tested as it would run against the real server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

# SGLang 0.5.23's sampling_params keys, in its JSON contract's order (sglang/api/v1/api_types.py,
# SamplingParams): any other key is refused.
SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
# the keys whose type the stand-in checks, as the contract does: (kind, serde's name for it)
_TYPED = {
    "max_new_tokens": ("int", "i64"),
    "temperature": ("number", "f64"),
    "top_p": ("number", "f64"),
    "top_k": ("int", "i64"),
    "sampling_seed": ("int", "i64"),
    "ignore_eos": ("bool", "a boolean"),
}
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _unexpected(v) -> str:
    """How serde names a JSON value in its errors (SGLang's contract errors quote it)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map"


def sampling_error(params) -> str | None:
    """SGLang's contract error for a sampling_params object, or None when it passes."""
    if not isinstance(params, dict):
        return f"invalid type: {_unexpected(params)}, expected struct SamplingParams"
    for key, value in params.items():
        if key not in SAMPLING_KEYS:
            listed = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            return f"unknown field `{key}`, expected one of {listed}"
        kind, name = _TYPED.get(key, (None, ""))
        if value is None or kind is None:
            continue
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
        }[kind]
        if not ok:
            return f"invalid type: {_unexpected(value)}, expected {name}"
    ids = params.get("stop_token_ids")
    if ids is not None and not isinstance(ids, list):
        return f"invalid type: {_unexpected(ids)}, expected a sequence"
    for i in ids or []:
        if not isinstance(i, int) or isinstance(i, bool):
            return f"invalid type: {_unexpected(i)}, expected i64"
    return None


def length_error(prompt: int, max_new_tokens: int, context: int | None) -> str | None:
    """SGLang's refusal of a request that does not fit the context (its tokenizer manager checks
    this before scheduling; it neither truncates the prompt nor shortens the completion)."""
    if context is None:
        return None
    if prompt >= context:
        return (
            f"The input ({prompt} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    if prompt + max_new_tokens > context:
        return (
            "Requested token count exceeds the model's maximum context length "
            f"of {context} tokens. You requested a total of {prompt + max_new_tokens} "
            f"tokens: {prompt} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )
    return None


def build_app(model_path: str, *, die_after: int | None = None, latency: float = 0.0):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from selfplay.engines import EngineRequestError, GenerationRequest, HFEngineConfig
    from selfplay.engines.hf import HFEngine

    engine = HFEngine(HFEngineConfig(model=model_path, device="cpu"))
    app = FastAPI()
    state = {
        "requests": 0,
        "model_path": model_path,
        "weight_version": "default",
        "load_format": "auto",
    }
    hf_config = engine.model.config

    def refuse(message: str) -> JSONResponse:  # a request SGLang's tokenizer manager refuses
        return JSONResponse({"error": {"message": message}}, status_code=400)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": state["model_path"],
            "served_model_name": state["model_path"],
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state["weight_version"],
            "load_format": state["load_format"],
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(hf_config, "model_type", None),
            "architectures": getattr(hf_config, "architectures", None),
        }

    @app.get("/v1/models")
    async def models():
        card = {
            "id": state["model_path"],
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": state["model_path"],
            "parent": None,
            "max_model_len": engine.max_context,
        }
        return {"object": "list", "data": [card]}

    class Refused(Exception):
        def __init__(self, message: str) -> None:
            self.message = message

    async def one(ids: list[int], params: dict, return_logprob: bool) -> dict:
        start = time.perf_counter()
        max_new = params.get("max_new_tokens")
        max_new = 128 if max_new is None else max_new
        problem = length_error(len(ids), max_new, engine.max_context)
        if problem:
            raise Refused(problem)
        if latency:
            await asyncio.sleep(latency)
        stops = tuple(params.get("stop_token_ids") or ())
        eos = engine.model.generation_config.eos_token_id
        if not params.get("ignore_eos") and eos is not None:  # SGLang stops at the model's EOS
            stops += tuple(eos) if isinstance(eos, list) else (eos,)
        temperature = params.get("temperature")
        top_p = params.get("top_p")
        try:
            gen = await engine.generate(
                GenerationRequest(
                    prompt_ids=ids,
                    max_new_tokens=max_new,
                    temperature=1.0 if temperature is None else float(temperature),
                    top_p=1.0 if top_p is None else float(top_p),
                    seed=params.get("sampling_seed"),
                    stop_token_ids=stops,
                )
            )
        except EngineRequestError as e:
            raise Refused(str(e)) from None
        finish = (
            {"type": "stop", "matched": gen.token_ids[-1]}
            if gen.finish_reason == "stop"
            else {"type": "length", "length": len(gen.token_ids)}
        )
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": state["weight_version"],
            "num_retractions": 0,
        }
        if return_logprob:
            meta["input_token_logprobs"] = []  # from the end of the prompt: none
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(gen.logprobs, gen.token_ids)
            ]
            meta["output_token_logprobs_length"] = len(gen.token_ids)
        meta.update(
            {
                "reasoning_tokens": 0,
                "completion_tokens": len(gen.token_ids),
                "cached_tokens": 0,
                "e2e_latency": time.perf_counter() - start,
                "response_sent_to_client_ts": time.time(),
            }
        )
        return {"text": gen.text, "output_ids": gen.token_ids, "meta_info": meta}

    @app.post("/generate")
    async def generate(body: dict):
        state["requests"] += 1
        if die_after is not None and state["requests"] > die_after:
            os._exit(1)  # a crash: no answer, the connection drops
        if "text" in body and "input_ids" not in body:
            return refuse("the stand-in supports input_ids only")
        ids = body.get("input_ids")
        params = body.get("sampling_params") or {}
        for p in params if isinstance(params, list) else [params]:
            problem = sampling_error(p)
            if problem:  # SGLang's JSON contract gate: before anything else
                return JSONResponse({"error": problem}, status_code=400)
        if not ids:
            return refuse("input_ids cannot be empty.")
        lp = bool(body.get("return_logprob", False))
        try:
            if isinstance(ids[0], list):
                plist = params if isinstance(params, list) else [params] * len(ids)
                outs = await asyncio.gather(*(one(i, p, lp) for i, p in zip(ids, plist)))
                return JSONResponse(list(outs))
            return JSONResponse(await one(ids, params, lp))
        except Refused as e:
            return refuse(e.message)

    @app.post("/update_weights_from_disk")
    async def update_weights(body: dict):
        path = body.get("model_path")
        if not isinstance(path, str):
            return JSONResponse({"detail": "model_path: a string is required"}, status_code=422)
        state["model_path"] = path
        state["load_format"] = body.get("load_format") or state["load_format"]
        state["weight_version"] = body.get("weight_version") or state["weight_version"]
        answer = {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }
        if body.get("weight_version"):
            answer["message"] += f" Weight version updated to {body['weight_version']}."
        return answer

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return Response(content=FLUSH_CACHE_TEXT, status_code=200)

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--pid-file", default=None)
    p.add_argument("--latency", type=float, default=0.0)
    args, _unknown = p.parse_known_args(argv)
    if args.pid_file:
        Path(args.pid_file).write_text(str(os.getpid()))
    import uvicorn

    app = build_app(args.model_path, die_after=args.die_after, latency=args.latency)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def install_fake_sglang(root: str | Path) -> Path:
    """Write ``root/sglang/launch_server.py`` running this stand-in; put ``root`` on PYTHONPATH."""
    pkg = Path(root) / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""Stand-in package: not SGLang."""\n')
    (pkg / "launch_server.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from sglang_standin import main\n"
        "main(sys.argv[1:])\n"
    )
    return Path(root)


if __name__ == "__main__":
    main()
