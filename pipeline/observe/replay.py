"""`eagle3 diagnose --replay`: the live diagnosis run over a recorded observation trace."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pipeline.observe.diagnosis import Diagnoser
from pipeline.verdict import Policy, VerdictRecord


@dataclass(frozen=True)
class ReplayLine:
    """One input line's outcome: a verdict, or the reason it was skipped."""

    lineno: int
    verdict: VerdictRecord | None = None
    skipped: str | None = None


def replay(lines: Iterable[str], *, policy: Policy | None = None) -> Iterator[ReplayLine]:
    """Diagnose each stage on its own history, one input line at a time."""
    diagnosers: dict[str, Diagnoser] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obs = json.loads(line)
        except ValueError as exc:
            yield ReplayLine(lineno, skipped=f"not JSON ({getattr(exc, 'msg', exc)})")
            continue
        if not isinstance(obs, dict) or not isinstance(obs.get("t"), (int, float)) or not isinstance(obs.get("stage"), str):
            yield ReplayLine(lineno, skipped='needs a numeric "t" and a string "stage"')
            continue
        for section in ("process", "progress", "files", "server"):
            if section in obs and not isinstance(obs[section], dict):
                obs[section] = None  # a malformed section is unknown, not an error
        if not isinstance(obs.get("gpus"), list):
            obs["gpus"] = None
        stage = obs["stage"]
        d = diagnosers.setdefault(stage, Diagnoser(stage=stage, policy=policy or Policy()))
        yield ReplayLine(lineno, verdict=d.feed(obs))
