"""Times given by a person: unix seconds or ISO 8601."""

from __future__ import annotations

from datetime import UTC, datetime

from pipeline.errors import UserError


def parse_time(text: str) -> float:
    """Unix seconds from '1790000000' or '2026-12-02T10:00:00' (naive = UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UserError(f"--since {text!r}: expected unix seconds or ISO 8601 such as 2026-12-02T10:00:00Z") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()
