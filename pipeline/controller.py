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

    def monitor_running(self) -> bool:
        """True when `eagle3 serve` stored a heartbeat within the last two ticks."""
        beat = self.store.get("monitor") or {}
        return self.store.clock() - beat.get("t", 0) <= 2 * self.ws.config.monitor.tick_s + 1

    def status(self, *, sample_if_unmonitored: bool = True) -> dict:
        """The status object of `eagle3 status --json`, from the store.

        With no monitor running, stages that are running are sampled once here (within
        the probe budget) so the answer is never older than this call.
        """
        self.supervisor.refresh()
        monitored = self.monitor_running()
        if not monitored and sample_if_unmonitored and any(
                self.supervisor.is_running(s) or self._unobserved_end(s) for s in STAGE_NAMES):
            from pipeline.sampler import Sampler

            sampler = Sampler(ws=self.ws, store=self.store)
            try:
                sampler.tick()
            finally:
                sampler.close()
        now = self.store.clock()
        return {"run": self.store.current_run(), "monitor": "running" if monitored else "not running",
                "stages": {stage: self._stage_status(stage, now) for stage in STAGE_NAMES}}

    def _unobserved_end(self, stage: str) -> bool:
        proc = self.store.latest_proc(stage)
        verdict = self.store.get(f"verdict:{stage}") or {}
        return bool(proc) and proc["state"] != "running" and (
            verdict.get("proc_id") != proc["id"] or not verdict.get("final"))

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
            "stop_requested": bool(proc["stop_requested"]), **self._verdict_fields(stage, proc),
        }

    def _verdict_fields(self, stage: str, proc: dict) -> dict:
        v = self.store.get(f"verdict:{stage}")
        if not v or v.get("proc_id") != proc["id"]:
            return {"verdict": "unknown", "progress_pct": None, "eta_s": None, "reasons": ["not observed yet"]}
        keys = ("verdict", "stuck", "progress_pct", "eta_s", "eta_low_s", "eta_high_s", "reasons", "done", "failed",
                "total", "rate_samples_per_s", "rate_tokens_per_s", "last_progress_at")
        fields = {k: v.get(k) for k in keys}
        fields["observed_at"] = v.get("t")
        return fields

    def logs(self, stage: str, *, lines: int = 50) -> tuple[Path, list[str]]:
        """The last lines of a stage's log."""
        self._check_stage(stage)
        path = self.ws.log_path(stage)
        return path, tail_lines(path, lines)
