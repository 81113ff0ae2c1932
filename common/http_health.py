"""A worker's HTTP side for Kubernetes and Prometheus: /health, /ready, /metrics on its own thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


class HealthServer:
    def __init__(self, host: str, port: int, ready_fn: Callable[[], tuple[bool, str]]) -> None:
        ready = ready_fn

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path == "/health":
                    self._reply(200, b'{"status":"ok"}', "application/json")
                elif self.path == "/ready":
                    ok, why = ready()
                    body = ('{"ready":true}' if ok else '{"ready":false,"reason":"%s"}' % why.replace('"', "'"))
                    self._reply(200 if ok else 503, body.encode(), "application/json")
                elif self.path == "/metrics":
                    self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                else:
                    self._reply(404, b"not found", "text/plain")

            def _reply(self, code: int, body: bytes, ctype: str) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the prober gave up (its timeout): nothing to answer

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="health-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
