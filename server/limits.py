"""The server's input bounds: the listening socket (bound before the artifact loads, so a bad or busy
port costs no load) and the request body limit (413 before any parsing or tokenizing). The limit's
default and its check live in runtime/checks.py: the CLI's parser shows the default without importing
the server.

Each check raises ValueError with one line; the CLI prints it and exits 2.
"""
from __future__ import annotations

import socket

from onegraph.runtime.checks import check_max_request_bytes

from .schema import ApiError


def check_port(port: int) -> int:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    return port


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it), or ValueError naming the address and the cause
    (in use, not permitted, not an address of this machine)."""
    check_port(port)
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a restart does not wait out TIME_WAIT
    try:
        sock.bind(info[4])
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class BodyLimit:
    """Pure ASGI: a request whose body exceeds `max_bytes` gets 413 (OpenAI-shaped) before the route reads
    it: at once from its Content-Length, else as soon as the streamed chunks pass the limit."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, check_max_request_bytes(max_bytes)

    def _error(self) -> ApiError:
        return ApiError(413, f"request body exceeds {self.max_bytes} bytes (serve --max-request-bytes)",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._error().response()(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:       # the route's catch-all answers it (app._GuardedRoute)
                    raise self._error()
            return msg
        await self.app(scope, limited, send)
