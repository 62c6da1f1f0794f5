"""The monitor loop inside `eagle3 serve`: heartbeat, then one sampler tick, every tick_s."""

from __future__ import annotations

import logging
import os
import threading
import time

from pipeline.automation import Automation
from pipeline.config import Workspace
from pipeline.observe.sampler import Sampler
from pipeline.store import KV, Store

log = logging.getLogger("eagle3.monitor")


class Monitor:
    """Runs ticks until stopped; owns its own store connection (sqlite is per thread)."""

    def __init__(self, *, ws: Workspace, clock=time.time, on_tick=None) -> None:
        self.ws, self.clock, self.on_tick = ws, clock, on_tick
        self.stopping = threading.Event()
        self.ticks = 0

    def run(self, *, max_ticks: int | None = None) -> None:
        """Tick until `stop()` (or `max_ticks`)."""
        store = Store(self.ws.store_path, clock=self.clock)
        sampler = Sampler(ws=self.ws, store=store, clock=self.clock)
        automation = Automation(ws=self.ws, store=store, gpu_probe=sampler.gpu, clock=self.clock)
        tick_s = self.ws.config.monitor.tick_s
        try:
            while not self.stopping.is_set():
                started = time.monotonic()
                store.put(KV.MONITOR, {"pid": os.getpid(), "t": self.clock(), "tick_s": tick_s})
                try:
                    results = sampler.tick()
                    automation.tick()
                    if self.on_tick:
                        self.on_tick(store, results)
                except Exception:  # noqa: BLE001 - one bad tick must not end monitoring
                    log.exception("monitor tick failed; continuing")
                self.ticks += 1
                if max_ticks is not None and self.ticks >= max_ticks:
                    break
                self.stopping.wait(max(0.0, tick_s - (time.monotonic() - started)))
        finally:
            store.put(KV.MONITOR, {"pid": os.getpid(), "t": 0, "tick_s": tick_s})
            sampler.close()
            store.close()

    def stop(self) -> None:
        """Ask the loop to end after the current tick."""
        self.stopping.set()
