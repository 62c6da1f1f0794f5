"""GPU probe over NVML (nvidia-ml-py, imported as pynvml), and a scripted fake.

Utilization is averaged over the whole tick from NVML's sample buffer: one
instantaneous reading covers only NVML's last 1/6–1 s, and a poll every 10 s of an
extraction that runs one request at a time sees mostly the idle gaps. No NVML is
unknown with its reason — never zeros.
"""

from __future__ import annotations

import threading
import time

from pipeline.observe.probes import Reading, known, unknown


class RealNvml:
    """A thin, raising wrapper over pynvml; GpuProbe turns its errors into unknowns."""

    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()

    def count(self) -> int:
        return self.nv.nvmlDeviceGetCount()

    def read(self, index: int, since_us: int) -> dict:
        nv, h = self.nv, self.nv.nvmlDeviceGetHandleByIndex(index)
        out: dict = {"index": index}
        try:
            _, samples = nv.nvmlDeviceGetSamples(h, nv.NVML_GPU_UTILIZATION_SAMPLES, since_us)
            values = [s.sampleValue.uiVal for s in samples if s.timeStamp > since_us]
            out["util"] = sum(values) / len(values) if values else None
            out["last_sample_us"] = max((s.timeStamp for s in samples), default=since_us)
        except nv.NVMLError:
            out["util"] = float(nv.nvmlDeviceGetUtilizationRates().gpu)
            out["util_note"] = "instantaneous (sample buffer not supported)"
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        out["mem_used_mb"] = mem.used / 2**20
        out["mem_total_mb"] = mem.total / 2**20
        out["name"] = _maybe(lambda: _text(nv.nvmlDeviceGetName(h)), nv)
        out["temp_c"] = _maybe(lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)), nv)
        out["power_w"] = _maybe(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, nv)
        out["power_limit_w"] = _maybe(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, nv)
        out["energy_mj"] = _maybe(lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h), nv)
        out["pids"] = _maybe(lambda: [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)], nv) or []
        return out


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _maybe(fn, nv):
    try:
        return fn()
    except nv.NVMLError:  # NotSupported on this board: unknown, not an error
        return None


class FakeNvml:
    """Scripted readings for tests and the demo: `script(tick) -> list of per-GPU dicts`."""

    def __init__(self, script, *, fail: str | None = None) -> None:
        if fail:
            raise RuntimeError(fail)
        self.script, self.tick = script, 0

    def count(self) -> int:
        return len(self.script(self.tick))

    def read(self, index: int, since_us: int) -> dict:
        rows = self.script(self.tick)
        if index == len(rows) - 1:
            self.tick += 1
        return dict(rows[index], index=index)


class GpuProbe:
    """Lazily initialised NVML behind a lock; readings with energy deltas and holders."""

    def __init__(self, *, backend_factory=RealNvml, clock=time.time) -> None:
        self.backend_factory = backend_factory
        self.clock = clock
        self._lock = threading.Lock()
        self._backend = None
        self._init_error: str | None = None
        self._since_us: dict[int, int] = {}
        self._energy: dict[int, float] = {}

    def _get(self):
        if self._backend is None and self._init_error is None:
            try:
                self._backend = self.backend_factory()
            except Exception as exc:  # noqa: BLE001 - NVMLError, ImportError, OSError: all mean "no NVML"
                self._init_error = f"NVML not available: {_describe(exc)}"
        return self._backend

    def read(self, pid_stage: dict[int, str] | None = None) -> Reading:
        """Per-GPU util (percent, tick average), memory, power, energy delta, holding stages."""
        with self._lock:
            backend = self._get()
            if backend is None:
                return unknown(self._init_error or "NVML is not available", clock=self.clock)
            try:
                return known([self._one(backend, i, pid_stage or {}) for i in range(backend.count())], clock=self.clock)
            except Exception as exc:  # noqa: BLE001
                return unknown(f"NVML read failed: {_describe(exc)}", clock=self.clock)

    def _one(self, backend, index: int, pid_stage: dict[int, str]) -> dict:
        raw = backend.read(index, self._since_us.get(index, int((self.clock() - 10) * 1e6)))
        if raw.get("last_sample_us"):
            self._since_us[index] = raw["last_sample_us"]
        energy = raw.get("energy_mj")
        prev = self._energy.get(index)
        if energy is not None:
            self._energy[index] = energy
        holders = sorted({pid_stage[p] for p in raw.get("pids", []) if p in pid_stage})
        return {"index": index, "util": raw.get("util"), "mem_used_mb": raw.get("mem_used_mb"),
                "power_w": raw.get("power_w"), "power_limit_w": raw.get("power_limit_w"),
                "name": raw.get("name"), "mem_total_mb": raw.get("mem_total_mb"), "temp_c": raw.get("temp_c"),
                "energy_j_delta": None if energy is None or prev is None else (energy - prev) / 1000.0,
                "holders": holders, "pids": raw.get("pids", [])}


def _describe(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "Driver Not Loaded" in text or "libnvidia-ml" in text or "NVML Shared Library Not Found" in text:
        return f"driver not loaded ({text})"
    return text


def idle_fake_gpus(count: int):
    """A FakeNvml script: `count` idle GPUs (what the demo and tests use by default)."""
    return lambda tick: [{"util": 0.0, "mem_used_mb": 1000.0, "power_w": 60.0, "power_limit_w": 700.0,
                          "energy_mj": 60_000.0 * tick, "pids": []} for _ in range(count)]


def nvml_or_fake(fake_gpus: int = 0, *, clock=time.time) -> GpuProbe:
    """NVML, or `fake_gpus` scripted idle GPUs (`[monitor] fake_gpus`: tests, the demo)."""
    return GpuProbe(backend_factory=(lambda: FakeNvml(idle_fake_gpus(fake_gpus))) if fake_gpus else RealNvml,
                    clock=clock)
