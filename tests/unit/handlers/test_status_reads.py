"""`/eagle3 status` reads the store in a few batched reads (issue 55: about 20 before): every stage's latest process
at once, the kv entries it shows at once, the run, the outbox, and each observed stage's latest observation."""

from __future__ import annotations

import pytest

from handlers.slash import answer
from pipeline.config import Workspace, parse_config
from pipeline.controller import Controller
from pipeline.store import Store
from pipeline.verdict import StoredVerdict, Verdict

pytestmark = pytest.mark.timeout(30)

BEFORE = 22  # SELECTs the same answer took before the reads were batched (measured with this test's counter)


def test_status_answers_with_at_most_half_the_reads_it_took_and_shows_what_it_read(tmp_path):
    cfg = ('[slack]\nchannel = "C1"\n[stages.server]\nargv = ["x"]\nurl = "http://127.0.0.1:1"\n'
           '[stages.extract]\nargv = ["x"]\nout = "out"\n[stages.train]\nargv = ["x"]\nout = "ckpt"\n')
    ws = Workspace(config=parse_config(cfg, name="e.toml"), path=tmp_path / "eagle3.toml")
    store = Store(ws.store_path)
    try:
        run = store.open_run()
        for stage in ("server", "extract"):
            pid = store.insert_proc({"run_id": run, "stage": stage, "state": "running", "pid": 1, "pgid": 1,
                                     "argv": "[]", "started_at": 1.0, "stop_requested": 0})
            store.put_verdict(stage, StoredVerdict(t=2.0, stage=stage, verdict=Verdict.PROGRESSING, reasons=("ok",),
                                                   proc_id=pid, run=run, done=5, total=10))
            store.add_observation({"t": 2.0, "stage": stage, "gpus": [{"index": 0, "util": 50.0}]}, run_id=run)
        ctl = Controller(workspace=ws, store=store)
        reads: list[str] = []
        store.db.conn.set_trace_callback(lambda sql: reads.append(sql) if sql.lstrip()[:6].upper() == "SELECT"
                                         else None)
        text, blocks = answer(ctl, "status", [], user="U1")
        store.db.conn.set_trace_callback(None)
    finally:
        store.close()
    assert len(reads) <= BEFORE // 2, reads
    assert len(reads) == 4 + 2, reads  # four batched reads, and the two observed stages' latest observations
    shown = str(blocks)
    assert "extract" in shown and f"Run {run}" in shown and f'"v": "{run}:off"' in shown.replace("\\", ""), shown


def test_read_only_verbs_build_no_supervisor(tmp_path, monkeypatch):
    """A status, an ETA or the GPUs read the store: no Supervisor, RealHost or SlurmExecutor is made for them."""
    from pipeline.stages import supervisor

    def refused(*a, **kw):
        raise AssertionError("a read-only verb built a Supervisor")

    monkeypatch.setattr(supervisor.Supervisor, "__init__", refused)
    ws = Workspace(config=parse_config('[stages.extract]\nargv = ["x"]\nout = "out"\n', name="e.toml"),
                   path=tmp_path / "eagle3.toml")
    store = Store(ws.store_path)
    try:
        ctl = Controller(workspace=ws, store=store)
        for verb in ("status", "eta", "stuck", "gpus"):
            answer(ctl, verb, [], user="U1")
    finally:
        store.close()
