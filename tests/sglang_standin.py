"""A local stand-in for an SGLang server: SGLang's HTTP wire format, backed by the hf engine.

Used where no GPU (and so no SGLang) is available. It speaks the parts of the API the client uses:
GET /health, GET /model_info, POST /generate (``input_ids``, one or a batch; ``sampling_params``
checked against SGLang 0.5.23's keys, an unknown key is HTTP 400 as there; ``return_logprob``
-> ``meta_info.output_token_logprobs`` as [[logprob, token_id, null], ...], the stop token
included; ``finish_reason`` {"type": "stop"|"length"}), POST /update_weights_from_disk and
POST /flush_cache. Concurrent requests are batched by the hf engine.

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

SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "n",
    "ignore_eos",
    "no_stop_trim",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "sampling_seed",
    "min_new_tokens",
    "json_schema",
    "regex",
}


def build_app(model_path: str, *, die_after: int | None = None, latency: float = 0.0):
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from selfplay.engines import EngineRequestError, GenerationRequest, HFEngineConfig
    from selfplay.engines.hf import HFEngine

    engine = HFEngine(HFEngineConfig(model=model_path, device="cpu"))
    app = FastAPI()
    state = {"requests": 0, "model_path": model_path, "weight_version": "default"}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/model_info")
    async def model_info():
        return {
            "model_path": state["model_path"],
            "tokenizer_path": state["model_path"],
            "is_generation": True,
            "max_context_length": engine.max_context,
        }

    async def one(ids: list[int], params: dict, return_logprob: bool) -> dict:
        unknown = set(params) - SAMPLING_KEYS
        if unknown:
            raise HTTPException(400, f"unknown sampling_params: {sorted(unknown)}")
        if not ids:
            raise HTTPException(400, "empty input_ids")
        start = time.perf_counter()
        if latency:
            await asyncio.sleep(latency)
        stops = tuple(params.get("stop_token_ids") or ())
        eos = engine.model.generation_config.eos_token_id
        if not params.get("ignore_eos") and eos is not None:  # SGLang stops at the model's EOS
            stops += tuple(eos) if isinstance(eos, list) else (eos,)
        try:
            gen = await engine.generate(
                GenerationRequest(
                    prompt_ids=ids,
                    max_new_tokens=int(params.get("max_new_tokens", 128)),
                    temperature=float(params.get("temperature", 1.0)),
                    top_p=float(params.get("top_p", 1.0)),
                    seed=params.get("sampling_seed"),
                    stop_token_ids=stops,
                )
            )
        except EngineRequestError as e:  # SGLang: an input longer than the context is a 400
            raise HTTPException(400, str(e)) from None
        finish = (
            {"type": "stop", "matched": gen.token_ids[-1]}
            if gen.finish_reason == "stop"
            else {"type": "length", "length": len(gen.token_ids)}
        )
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(gen.token_ids),
            "cached_tokens": 0,
            "weight_version": state["weight_version"],
            "e2e_latency": time.perf_counter() - start,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(gen.logprobs, gen.token_ids)
            ]
        return {"text": gen.text, "output_ids": gen.token_ids, "meta_info": meta}

    @app.post("/generate")
    async def generate(body: dict):
        state["requests"] += 1
        if die_after is not None and state["requests"] > die_after:
            os._exit(1)  # a crash: no answer, the connection drops
        if "text" in body and "input_ids" not in body:
            raise HTTPException(400, "the stand-in supports input_ids only")
        ids = body.get("input_ids")
        params = body.get("sampling_params") or {}
        lp = bool(body.get("return_logprob", False))
        if ids and isinstance(ids[0], list):
            plist = params if isinstance(params, list) else [params] * len(ids)
            outs = await asyncio.gather(*(one(i, p, lp) for i, p in zip(ids, plist)))
            return JSONResponse(list(outs))
        return JSONResponse(await one(ids or [], params, lp))

    @app.post("/update_weights_from_disk")
    async def update_weights(body: dict):
        state["model_path"] = body.get("model_path", state["model_path"])
        state["weight_version"] = body.get("weight_version") or state["weight_version"]
        return {"success": True, "message": "stand-in: weights path recorded, not reloaded"}

    @app.post("/flush_cache")
    async def flush_cache():
        return {}

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
