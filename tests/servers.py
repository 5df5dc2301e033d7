"""Local servers for tests: a free port, a server script started on it, its health awaited.

The SGLang and router stand-ins (``sglang_standin.py``, ``router_standin.py``) and ``transformers
serve`` are started through here, so every test starts, waits for and stops them the same way.
``not_json_server`` is a healthy server that answers every POST with a page that is not JSON
(as a proxy in front of the engine would).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str]) -> tuple[str, subprocess.Popen]:
    """Start ``python ARGS --port P`` on a free port; (its URL, the process)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return f"http://127.0.0.1:{port}", proc


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    """Return once ``url``/health answers 200; fail at once if the server exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server for {url} exited"
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


@contextlib.contextmanager
def running(args: list[str]) -> Iterator[str]:
    """A healthy server from ``serve(args)`` for the block; killed after it."""
    url, proc = serve(args)
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.kill()
        proc.wait()


class _NotJSON(BaseHTTPRequestHandler):
    page = b"<html><body>502 Bad Gateway: the upstream engine is asleep</body></html>" * 10

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"ok", "text/plain")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._send(200, self.page, "text/html")

    def log_message(self, *args) -> None:  # quiet
        pass


@contextlib.contextmanager
def not_json_server() -> Iterator[str]:
    """A server (in a thread) whose /health is 200 and whose every POST answer is an HTML page."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotJSON)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
