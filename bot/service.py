"""`eagle3 serve`: the monitor tick plus the transports, in one process."""

from __future__ import annotations

import signal
import sys
import threading
import time

from handlers.views import event_text
from pipeline.config import Workspace
from pipeline.monitor import Monitor


class ConsoleEvents:
    """Prints new events (verdicts, handoff steps, restarts, reminders) as they are recorded."""

    def __init__(self, out=sys.stdout, *, since_t: float | None = None) -> None:
        self.out = out
        self.since_t = time.time() if since_t is None else since_t
        self.after_id = 0

    def __call__(self, store, _results) -> None:
        for event in store.events(after_id=self.after_id):
            self.after_id = event["id"]
            line = event_text(event) if event["t"] >= self.since_t else None  # older history: `eagle3 status`
            if line:
                print(line, file=self.out, flush=True)


def serve(ws: Workspace, *, max_ticks: int | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `max_ticks`)."""
    monitor = Monitor(ws=ws, on_tick=ConsoleEvents())

    def stop(_signum, _frame):
        monitor.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    print(f"eagle3 serve: monitoring {ws.path} every {ws.config.monitor.tick_s:g} s; "
          "console transport (no Slack tokens); Ctrl-C to stop", flush=True)
    monitor.run(max_ticks=max_ticks)
    print("eagle3 serve: stopped (stages keep running)", flush=True)
    return 0
