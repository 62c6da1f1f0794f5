"""App Home: on `app_home_opened` the Home tab shows the run's status, the latest chart the bot
uploaded (an image block naming the Slack file) and the run's last five events."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from handlers.render.alerts import event_message
from handlers.render.blocks import status_blocks
from handlers.render.views import slack_time
from pipeline.states import StateVersion
from pipeline.status import RunStatus

log = logging.getLogger("eagle3.home")
RECENT = 5


def home_view(status: RunStatus, *, version: StateVersion, events: list[dict], chart: dict | None = None) -> dict:
    """The Home tab: the status post's blocks (without its buttons: they act on a channel message),
    the latest uploaded chart (`{"file_id", "stage", "t"}`, None: no chart yet) and the last events
    worth a message, newest first."""
    _, blocks = status_blocks(status, version=version)
    blocks = [b for b in blocks if b.get("type") != "actions"]
    if chart and chart.get("file_id"):
        blocks.append({"type": "image", "slack_file": {"id": chart["file_id"]},
                       "alt_text": f"chart of {chart.get('stage', 'the run')}",
                       "title": {"type": "plain_text", "text": f"{chart.get('stage', 'run')}, drawn "
                                 f"{datetime.fromtimestamp(chart.get('t', 0), tz=UTC):%H:%M} UTC"}})
    lines = []
    for e in reversed(events):
        msg = event_message(e, oncall=[])
        if msg:
            lines.append(f"{slack_time(e['t'], '{date_short_pretty} {time}')} — {msg[1]}")
        if len(lines) == RECENT:
            break
    blocks.append({"type": "divider"})
    blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "*Last events*\n" + (
        "\n".join(lines) if lines else "none yet")[:2900]}})
    return {"type": "home", "blocks": blocks}


def register(app, *, controller_factory) -> None:
    """Attach the app_home_opened listener (Bolt acks events itself, before the listener runs)."""

    @app.event("app_home_opened")
    def opened(event, client):
        if event.get("tab", "home") != "home" or not event.get("user"):
            return
        ctl = controller_factory()
        try:
            status = ctl.status(sample_if_unmonitored=False)
            view = home_view(status, version=ctl.state_version(), events=ctl.recent_events(50),
                             chart=ctl.latest_chart())
        finally:
            ctl.close()
        client.views_publish(user_id=event["user"], view=view)
