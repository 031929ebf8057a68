"""Timing the server's readiness endpoint while a test keeps it busy with something else."""

from __future__ import annotations

import http.client
import threading
import time


class HealthProbe:
    """``GET /v2/health/ready`` every ``interval`` seconds on a thread, each answer's latency kept.

    ``with HealthProbe(port) as probe: <load>`` then ``probe.worst`` (seconds) and ``probe.statuses``.
    """

    def __init__(self, port: int, interval: float = 0.02) -> None:
        self.port = port
        self.interval = interval
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        while not self.latencies and self._thread.is_alive():  # one answer before the load starts
            time.sleep(0.005)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def worst(self) -> float:
        return max(self.latencies)

    def _run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            while not self._stop.is_set():
                start = time.perf_counter()
                connection.request("GET", "/v2/health/ready")
                response = connection.getresponse()
                response.read()
                self.latencies.append(time.perf_counter() - start)
                self.statuses.append(response.status)
                self._stop.wait(self.interval)
        finally:
            connection.close()
