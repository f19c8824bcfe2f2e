"""Run an app with uvicorn on a loopback port in a background thread (tests, soak, benchmarks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", log_config: Any = None) -> Iterator[str]:
    """Serve ``app`` on a free port of ``host``; yields its base URL and stops it on exit.

    ``log_config=None`` leaves logging to the caller (records reach the root logger)."""
    config = uvicorn.Config(app, host=host, port=0, log_level="warning", log_config=log_config)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
