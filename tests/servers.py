"""Local servers for tests: a free port, a server script started on it, its health awaited.

The SGLang and router stand-ins (``sglang_standin.py``, ``router_standin.py``) and ``transformers
serve`` are started through here, so every test starts, waits for and stops them the same way.
``not_json_server`` is a healthy server that answers every POST with a page that is not JSON
(as a proxy in front of the engine would). ``stub_server`` answers each POST with the next of a
list of ``Reply`` (then the last one again): a status, headers, a body, and optionally that body
dripped one byte every ``drip_s`` seconds (a server that is slow forever, never silent).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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


@dataclass
class Reply:
    """One answer of ``stub_server``; ``drip_s``: send the body a byte at a time, this far apart
    (its content-length says the whole body, so the client waits for the rest); ``length``
    False: no content-length, the body ends when the connection closes (HTTP/1.0)."""

    status: int = 200
    body: bytes = b"{}"
    headers: dict[str, str] = field(default_factory=dict)
    drip_s: float | None = None
    length: bool = True


class _Stub(BaseHTTPRequestHandler):
    replies: list[Reply]
    seen: list[str]

    def do_GET(self) -> None:
        body = b"ok" if self.path == "/health" else b"{}"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.seen.append(self.path)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        self.send_response(reply.status)
        self.send_header("content-type", "application/json")
        if reply.length:
            self.send_header("content-length", str(len(reply.body)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        try:
            if reply.drip_s is None:
                self.wfile.write(reply.body)
                return
            for i in range(len(reply.body)):
                self.wfile.write(reply.body[i : i + 1])
                self.wfile.flush()
                time.sleep(reply.drip_s)
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: as it should
            pass

    def log_message(self, *args) -> None:  # quiet
        pass


class StubServer(ThreadingHTTPServer):
    daemon_threads = True  # a drip never holds up the shutdown


@contextlib.contextmanager
def stub_server(replies: list[Reply]) -> Iterator[tuple[str, list[str]]]:
    """A server (in a thread) whose /health is 200 and whose POSTs get ``replies`` in order (the
    last one again and again); (its URL, the paths it was POSTed to, in order)."""
    seen: list[str] = []
    handler = type("Stub", (_Stub,), {"replies": list(replies), "seen": seen})
    server = StubServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
