"""The monitor loop inside `eagle3 serve`: heartbeat, then one sampler tick, every tick_s."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from pipeline.automation import Automation
from pipeline.config import LiveWorkspace, Workspace
from pipeline.observe.sampler import Sampler
from pipeline.store import KV, Store

log = logging.getLogger("eagle3.monitor")


class Monitor:
    """Runs ticks until stopped; owns its own store connection (sqlite is per thread). It reads the config file as
    it is (`LiveWorkspace`): an edit that loads is used from the next tick on, as the CLI uses it."""

    def __init__(self, *, ws: Workspace, clock=time.time, on_tick=None, live: LiveWorkspace | None = None) -> None:
        self.live = live or LiveWorkspace(ws)
        self.ws, self.clock, self.on_tick = self.live.current(), clock, on_tick
        self.stopping = threading.Event()
        self.ticks = 0
        self.config_sha = _sha(self.ws.path)  # the file as it was last said in the channel
        self.config_changes = self.live.changes

    def check_config(self, store: Store) -> bool:
        """Follow the config file: when it changed, say once in the channel whether serve now uses it (it loads)
        or keeps the settings it had (it does not, with the one-line error, also shown in `status` until fixed).
        True when the workspace to use changed."""
        ws = self.live.current()
        changed = ws is not self.ws
        self.ws = ws
        if self.live.changes == self.config_changes:
            return changed
        self.config_changes = self.live.changes
        sha = _sha(ws.path)  # read only when the file was seen to change: a save with the same text says nothing
        if sha != self.config_sha:
            self.config_sha = sha
            store.put(KV.CONFIG_CHANGED, {"t": self.clock(), "sha": sha, "error": self.live.error,
                                          "file": str(ws.path)} if self.live.error else None)
            store.add_event(kind="config-changed", run_id=store.current_run(),
                            data={"file": ws.path.name, "error": self.live.error})
        return changed

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
                    if self.check_config(store):  # the edited file: its stages, rules and thresholds from now on
                        sampler.close()
                        sampler = Sampler(ws=self.ws, store=store, clock=self.clock)
                        automation = Automation(ws=self.ws, store=store, gpu_probe=sampler.gpu, clock=self.clock)
                        tick_s = self.ws.config.monitor.tick_s
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


def _sha(path: Path) -> str | None:
    """The file's sha256, or None when it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
