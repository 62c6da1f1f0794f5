"""The controller: the only door into the pipeline for the CLI and the bot."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import STAGE_NAMES, Workspace, find_config, load_workspace
from pipeline.errors import StageError
from pipeline.logfile import tail_lines
from pipeline.states import StageState
from pipeline.store import Store
from pipeline.supervisor import StopResult, Supervisor


class Controller:
    """Verbs over one workspace: start, stop, status, logs."""

    def __init__(self, *, workspace: Workspace, store: Store | None = None, host=None) -> None:
        self.ws = workspace
        self.store = store or Store(workspace.store_path)
        self.supervisor = Supervisor(workspace=workspace, store=self.store, host=host)

    @classmethod
    def open(cls, config: str | None) -> Controller:
        """Find the config, load it and open its store."""
        return cls(workspace=load_workspace(find_config(config)))

    def close(self) -> None:
        """Release the store."""
        self.store.close()

    def _check_stage(self, stage: str) -> None:
        if stage not in STAGE_NAMES:
            raise StageError(f"unknown stage {stage!r}; choose one of {', '.join(STAGE_NAMES)}")

    def start(self, stage: str) -> dict:
        """Start a stage; returns its process row."""
        self._check_stage(stage)
        return self.supervisor.start(stage)

    def stop(self, stage: str, *, grace_s: float | None = None) -> StopResult:
        """Stop one stage (SIGTERM, grace, SIGKILL)."""
        self._check_stage(stage)
        return self.supervisor.stop(stage, grace_s=self._grace(stage, grace_s))

    def stop_all(self, *, grace_s: float | None = None) -> list[StopResult]:
        """Stop every stage and close the run."""
        return self.supervisor.stop_all(grace_s=self._grace("server", grace_s))

    def _grace(self, stage: str, grace_s: float | None) -> float:
        if grace_s is not None:
            return grace_s
        return self.ws.config.handoff.server_stop_grace_s if stage == "server" else 30.0

    def status(self) -> dict:
        """The status object of `eagle3 status --json`, from the store."""
        self.supervisor.refresh()
        now = self.store.clock()
        return {"run": self.store.current_run(),
                "stages": {stage: self._stage_status(stage, now) for stage in STAGE_NAMES}}

    def _stage_status(self, stage: str, now: float) -> dict:
        proc = self.store.latest_proc(stage)
        if not proc:
            return {"state": str(StageState.NOT_STARTED), "pid": None, "exit_code": None, "signal": None,
                    "started_at": None, "ended_at": None, "uptime_s": None,
                    "log": str(self.ws.log_path(stage)), "reason": None, "run": None}
        running = proc["state"] == StageState.RUNNING
        return {
            "state": proc["state"], "pid": proc["pid"], "exit_code": proc["exit_code"], "signal": proc["signal"],
            "started_at": proc["started_at"], "ended_at": proc["ended_at"],
            "uptime_s": round(now - proc["started_at"], 1) if running and proc["started_at"] else None,
            "log": proc["log"], "reason": proc["reason"], "run": proc["run_id"],
            "stop_requested": bool(proc["stop_requested"]),
        }

    def logs(self, stage: str, *, lines: int = 50) -> tuple[Path, list[str]]:
        """The last lines of a stage's log."""
        self._check_stage(stage)
        path = self.ws.log_path(stage)
        return path, tail_lines(path, lines)
