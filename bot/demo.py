"""`eagle3 demo`: a tour in a temporary workspace, leaving nothing running.

Until the toy pipeline exists this tours the supervision layer: it starts stand-in
stages, shows status and logs, and stops everything.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from handlers.views import status_text, stop_text
from pipeline.config import load_workspace
from pipeline.controller import Controller

_WORKER = (
    "import time\n"
    "for i in range(1, 201):\n"
    "    print(f'sample {i}/200', flush=True)\n"
    "    time.sleep(0.01)\n"
)
_SERVER = "import time\nprint('stand-in server ready', flush=True)\ntime.sleep(600)\n"


def run_demo() -> int:
    """Run the tour; returns the exit status."""
    with tempfile.TemporaryDirectory(prefix="eagle3-demo-") as tmp:
        cfg = Path(tmp) / "eagle3.toml"
        cfg.write_text(
            f"[stages.server]\nargv = {json.dumps([sys.executable, '-c', _SERVER])}\n"
            f"[stages.extract]\nargv = {json.dumps([sys.executable, '-c', _WORKER])}\n"
        )
        ctl = Controller(workspace=load_workspace(cfg))
        try:
            print(f"workspace: {tmp}")
            for stage in ("server", "extract"):
                proc = ctl.start(stage)
                print(f"started {stage}: pid {proc['pid']} in its own process group, run {proc['run_id']}")
            deadline = time.monotonic() + 30
            while ctl.status()["stages"]["extract"]["state"] == "running" and time.monotonic() < deadline:
                time.sleep(0.2)
            print("\n" + status_text(ctl.status()))
            _, lines = ctl.logs("extract", lines=2)
            print("\nlast lines of the extract log:\n  " + "\n  ".join(lines))
            print()
            for result in ctl.stop_all(grace_s=5):
                print(stop_text(result))
        finally:
            ctl.stop_all(grace_s=2)
            ctl.close()
    print("\nThe toy SGLang server, extraction, diagnosis, handoff and Slack views are not built yet.")
    return 0
