"""A local stand-in for an SGLang router in front of several SGLang servers (workers).

It speaks what the client uses of sglang-router: GET /health, GET /model_info (the first
worker's), POST /generate (sent round-robin to the workers, answered as they answer) and GET
/list_workers ({"urls": [...]}). Weight reloads are not routed (HTTP 404 here): the client must
reach every worker itself. ``GET /routed`` (a test hook) counts the requests sent to each worker.

    python router_standin.py --port P --workers http://127.0.0.1:A,http://127.0.0.1:B
"""

import argparse
import itertools


def build_app(workers: list[str]):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()
    client = httpx.AsyncClient(timeout=600.0)
    turn = itertools.cycle(range(len(workers)))
    routed = {w: 0 for w in workers}

    @app.get("/health")
    async def health():
        codes = [(await client.get(f"{w}/health")).status_code for w in workers]
        return JSONResponse({}, status_code=200 if all(c == 200 for c in codes) else 503)

    @app.get("/model_info")
    async def model_info():
        return (await client.get(f"{workers[0]}/model_info")).json()

    @app.get("/list_workers")
    async def list_workers():
        return {"urls": workers}

    @app.get("/routed")
    async def count():
        return routed

    @app.post("/generate")
    async def generate(request: Request):
        worker = workers[next(turn)]
        routed[worker] += 1
        r = await client.post(f"{worker}/generate", json=await request.json())
        return JSONResponse(r.json(), status_code=r.status_code)

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", required=True)
    args = p.parse_args()
    import uvicorn

    uvicorn.run(build_app(args.workers.split(",")), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
