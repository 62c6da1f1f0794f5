"""What every client stage of the target's SGLang server takes (`eagle3 extract`, `eagle3 regenerate`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ClientOptions:
    """A resumable pass of `data` through the server at `server`, written into `out`."""

    server: str
    data: Path
    out: Path
    concurrency: int = 32  # requests in flight
    max_retries: int = 3  # retries of a failed request or a bad answer
    timeout_s: float = 600.0  # one request's
    server_wait_s: float = 600.0  # how long an unreachable server is waited for
    force: bool = False  # continue into an OUT made from another input
