"""SGLang server probe: health, server info, metrics. Counters are activity, never progress.

The server's request counter counts health checks and every other client; in the
incident it read 22,391 while the true sample index was 18,424.
"""

from __future__ import annotations

import re
import time

import httpx

from pipeline.probes import Reading, known, unknown

_METRIC = re.compile(r"^(sglang:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")
INFO_REFRESH_S = 600.0


def parse_metrics(text: str) -> dict[str, float]:
    """Sum each sglang:* metric over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m and m.group(3) != "NaN":
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


class ServerProbe:
    """Reads one SGLang server over HTTP (loopback in tests, the GPU host in production)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, clock=time.time, transport=None) -> None:
        self.url = url.rstrip("/")
        self.clock = clock
        self.client = httpx.Client(timeout=timeout_s, transport=transport)
        self._info: dict | None = None
        self._info_at = float("-inf")

    def read(self) -> Reading:
        """{healthy, health_status, running_reqs, queue_reqs, requests_total, version} or unknown."""
        value: dict = {}
        try:
            r = self.client.get(f"{self.url}/health_generate")
            value["healthy"] = r.status_code == 200
            value["health_status"] = r.status_code
        except httpx.TimeoutException:
            value.update(healthy=False, health_status="timeout")
        except httpx.HTTPError as exc:
            return unknown(f"server at {self.url} unreachable: {type(exc).__name__}", clock=self.clock)
        value.update(self._metrics())
        info = self.info()
        if info:
            value["version"] = info.get("version")
        return known(value, clock=self.clock)

    def info(self) -> dict | None:
        """/get_server_info, cached for a few minutes."""
        if self.clock() - self._info_at > INFO_REFRESH_S:
            try:
                r = self.client.get(f"{self.url}/get_server_info")
                self._info = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                self._info = None
            self._info_at = self.clock()
        return self._info

    def _metrics(self) -> dict:
        try:
            r = self.client.get(f"{self.url}/metrics")
        except httpx.HTTPError:
            return {}
        if r.status_code != 200:
            return {}
        m = parse_metrics(r.text)
        pick = {"running_reqs": "sglang:num_running_reqs", "queue_reqs": "sglang:num_queue_reqs",
                "requests_total": "sglang:num_requests_total"}
        return {k: m[v] for k, v in pick.items() if v in m}

    def close(self) -> None:
        """Close the HTTP client."""
        self.client.close()
