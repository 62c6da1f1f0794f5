"""Who may do what through Slack; every decision is audited."""

from __future__ import annotations

import os
import re

from pipeline.config import SECRET_ENV

MUTATING = frozenset({"autostart on", "autostart off", "train", "stop", "restart"})  # `later` only reminds
_SECRETS = [re.compile(r"xox[abposr]-[0-9A-Za-z-]+"), re.compile(r"xapp-[0-9A-Za-z-]+"),
            re.compile(r"(?i)(authorization:\s*)(bearer\s+)?\S+"), re.compile(r"(?i)(signing[_-]?secret\S*\s*[=:]\s*)\S+")]


def refusal(slack_cfg, *, user: str, channel: str | None, mutating: bool) -> str | None:
    """Why this user may not act here, or None. Checked before any other reason to refuse."""
    if slack_cfg.allowed_channel_ids and channel not in slack_cfg.allowed_channel_ids:
        return "this channel is not allowed to use eagle3; add it to [slack] allowed_channel_ids in eagle3.toml"
    if not mutating:
        return None
    if not slack_cfg.allowed_user_ids:
        return ("no one may change the pipeline from Slack yet: list the allowed user ids in [slack] "
                "allowed_user_ids in eagle3.toml")
    if user not in slack_cfg.allowed_user_ids:
        return f"<@{user}> is not allowed to change the pipeline; ask an operator to add you to [slack] allowed_user_ids"
    return None


def redact(text: str, extra: list[str] = (), patterns: list[str] = ()) -> str:
    """Mask tokens, Authorization headers, signing secrets, this service's own Slack secrets,
    the given secret values and `patterns`."""
    extra = [*extra, *(os.environ.get(k, "") for k in SECRET_ENV)]
    for pattern in _SECRETS:
        text = pattern.sub(lambda m: (m.group(1) if m.lastindex else "") + "[redacted]", text)
    for secret in extra:
        if secret:
            text = text.replace(secret, "[redacted]")
    for pattern in patterns:
        text = re.sub(pattern, "[redacted]", text)
    return text
