"""The monitor loop inside `eagle3 serve`: heartbeat, then one sampler tick, every tick_s."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from pipeline.automation import Automation
from pipeline.config import ConfigError, Workspace, load_workspace
from pipeline.observe.sampler import Sampler
from pipeline.store import KV, Store

log = logging.getLogger("eagle3.monitor")


class Monitor:
    """Runs ticks until stopped; owns its own store connection (sqlite is per thread)."""

    def __init__(self, *, ws: Workspace, clock=time.time, on_tick=None) -> None:
        self.ws, self.clock, self.on_tick = ws, clock, on_tick
        self.stopping = threading.Event()
        self.ticks = 0
        self.config_seen = _file_state(ws.path)  # (mtime, size, sha256) of the config serve runs with
        self.config_started = self.config_seen[2] if self.config_seen else None

    def check_config(self, store: Store) -> None:
        """Say once (an event, and in status) when the config file no longer reads as it did when serve started:
        serve — the monitor, auto-start and the Slack commands — keeps the settings it started with until it is
        restarted, while the CLI reads the file; a file changed back clears it."""
        path = self.ws.path
        try:
            st = path.stat()
        except OSError:
            return
        if self.config_seen and (st.st_mtime_ns, st.st_size) == self.config_seen[:2]:
            return
        self.config_seen = _file_state(path)
        sha = self.config_seen[2] if self.config_seen else None
        noted = store.get(KV.CONFIG_CHANGED)
        if sha == self.config_started:
            if noted:
                store.put(KV.CONFIG_CHANGED, None)
            return
        if noted and noted.get("sha") == sha:
            return
        try:
            load_workspace(path)
            error = None
        except ConfigError as exc:
            error = str(exc)
        store.put(KV.CONFIG_CHANGED, {"t": self.clock(), "sha": sha, "error": error, "file": str(path)})
        store.add_event(kind="config-changed", run_id=store.current_run(), data={"file": path.name, "error": error})

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
                    self.check_config(store)
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


def _file_state(path: Path) -> tuple[int, int, str] | None:
    """(mtime in ns, size, sha256) of a file, or None when it cannot be read."""
    try:
        st = path.stat()
        return st.st_mtime_ns, st.st_size, hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
