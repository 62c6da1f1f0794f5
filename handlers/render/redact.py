"""Secrets masked out of any text the bot posts: log excerpts, alert evidence."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from pipeline.config import SECRET_ENV

_SECRETS = [re.compile(r"xox[abposr]-[0-9A-Za-z-]+"), re.compile(r"xapp-[0-9A-Za-z-]+"),
            re.compile(r"(?i)(authorization:\s*)(bearer\s+)?\S+"), re.compile(r"(?i)(signing[_-]?secret\S*\s*[=:]\s*)\S+")]


def redact(text: str, extra: Sequence[str] = (), patterns: Sequence[str] = ()) -> str:
    """Mask tokens, Authorization headers, signing secrets, this service's own Slack secrets,
    the given secret values and `patterns`."""
    extra = [*extra, *(os.environ.get(k, "") for k in SECRET_ENV)]
    for secret_re in _SECRETS:
        text = secret_re.sub(lambda m: (m.group(1) if m.lastindex else "") + "[redacted]", text)
    for secret in extra:
        if secret:
            text = text.replace(secret, "[redacted]")
    for pattern in patterns:
        text = re.sub(pattern, "[redacted]", text)
    return text
