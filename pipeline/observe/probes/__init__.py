"""Probes: readings that never raise. Unknown is a value, with its reason."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("eagle3.probes")
_logged: set[str] = set()


@dataclass(frozen=True)
class Reading:
    """A probe's result at time t: a value, or None with the reason it is unknown."""

    t: float
    value: Any = None
    unknown: str | None = None


def known(value: Any, *, clock=time.time) -> Reading:
    """A successful reading."""
    return Reading(t=clock(), value=value)


def unknown(reason: str, *, clock=time.time) -> Reading:
    """An unknown reading, logged once per distinct reason."""
    if reason not in _logged:
        _logged.add(reason)
        log.info("probe reading unknown: %s", reason)
    return Reading(t=clock(), unknown=reason)
