"""The console transport: Slack's Web API calls the notifier makes, printed as the messages would appear."""

from __future__ import annotations

import sys
import threading
import time

from handlers.render.blocks import blocks_text


class ConsoleClient:
    """Stands in for slack_sdk's WebClient in `Notifier` when no Slack tokens are set."""

    def __init__(self, out=None) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.n = 0

    def _print(self, head: str, text: str, blocks: list | None) -> str:
        with self.lock:
            self.n += 1
            body = blocks_text(blocks or [], text).replace("\n", "\n    ")
            print(f"[{time.strftime('%H:%M:%S')}] {head}{body}", file=self.out or sys.stdout, flush=True)
            return f"console.{self.n:06d}"

    def chat_postMessage(self, *, channel: str, text: str, blocks=None, thread_ts=None, **_) -> dict:  # noqa: N802
        return {"ok": True, "channel": channel, "ts": self._print("  ↳ " if thread_ts else "", text, blocks)}

    def files_upload_v2(self, *, channel: str, file: str, initial_comment: str = "", thread_ts=None, **_) -> dict:
        """A chart: its comment and where the PNG lies (the console cannot show it)."""
        self._print("  ↳ " if thread_ts else "", f"{initial_comment} [chart: {file}]", None)
        return {"ok": True, "channel": channel, "file": {"id": None}}

    def chat_update(self, *, channel: str, ts: str, text: str, blocks=None, **_) -> dict:
        self._print("(status updated) ", text, blocks)
        return {"ok": True, "channel": channel, "ts": ts}
