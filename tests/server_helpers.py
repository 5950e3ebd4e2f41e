"""A real uvicorn server on 127.0.0.1 (an ephemeral port) in a thread, for the server tests."""
import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def running(app, log_level: str = "warning"):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    t0 = time.time()
    while not server.started:
        assert th.is_alive() and time.time() - t0 < 30, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(15)
        sock.close()
