"""Serving the OpenAI API on a socket: uvicorn on a thread of its own (a run's agent environments talk to it while
the run goes on) or in the foreground (``moerl serve``)."""

from __future__ import annotations

import socket
import threading
import time

from moerl.errors import ConfigError

LOOPBACK = "127.0.0.1"


class Listening:
    """uvicorn serving ``app`` on ``host``:``port`` (0: a free port) from a thread; ``url`` is its ``/v1`` base."""

    def __init__(self, app, host: str = LOOPBACK, port: int = 0, timeout_s: float = 30.0) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
        self.host, self.port = host, sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/v1"
        # no access log: a run's agents make thousands of requests
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="moerl-serve", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI server on {self.url} did not start")
            time.sleep(0.01)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop accepting, let requests in flight finish (up to a few seconds), stop."""
        self.server.should_exit = True
        self._thread.join()
