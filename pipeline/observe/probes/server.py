"""SGLang server probe: health, server info, metrics. Counters are activity, never progress.

The server's request counter counts health checks and every other client; in the
incident it read 22,391 while the true sample index was 18,424.
"""

from __future__ import annotations

import math
import time

import httpx

from pipeline.observe.probes import Reading, known, unknown

INFO_REFRESH_S = 600.0
INFO_PATHS = ("/server_info", "/get_server_info")  # 0.5.23's name first; the old one logs a warning per call


def parse_metrics(text: str) -> dict[str, float]:
    """Sum each SGLang sample over its label sets, named `sglang:…` whichever prefix the server used
    (`sglang:` and `sglang_` both occur). Raises ValueError on text that is not Prometheus' format."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.startswith("sglang_"):
                name = "sglang:" + name[len("sglang_"):]
            if name.startswith("sglang:") and not math.isnan(sample.value):
                out[name] = out.get(name, 0.0) + float(sample.value)
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
            r = self.client.get(f"{self.url}/health")  # liveness; /health_generate runs a generation
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
        """/server_info (or the deprecated /get_server_info), cached for a few minutes."""
        if self.clock() - self._info_at > INFO_REFRESH_S:
            self._info = None
            for path in INFO_PATHS:
                try:
                    r = self.client.get(f"{self.url}{path}")
                    if r.status_code == 200 and isinstance(body := r.json(), dict):
                        self._info = body
                        break
                except (httpx.HTTPError, ValueError):
                    continue
            self._info_at = self.clock()
        return self._info

    def _metrics(self) -> dict:
        try:
            r = self.client.get(f"{self.url}/metrics")
        except httpx.HTTPError:
            return {}
        if r.status_code != 200:
            return {"metrics_unknown": f"/metrics answered {r.status_code} (start SGLang with --enable-metrics)"}
        try:
            m = parse_metrics(r.text)
        except ValueError as exc:
            return {"metrics_unknown": f"/metrics is not in Prometheus' text format ({exc})"}
        pick = {"running_reqs": "sglang:num_running_reqs", "queue_reqs": "sglang:num_queue_reqs",
                "requests_total": "sglang:num_requests_total"}
        return {k: m[v] for k, v in pick.items() if v in m}

    def close(self) -> None:
        """Close the HTTP client."""
        self.client.close()
