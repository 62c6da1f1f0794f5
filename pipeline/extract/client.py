"""`eagle3 extract`: send every sample to the server and store validated hidden states.

Async, with a bounded number of requests in flight. A sample is counted only after
its file is validated, fsync-ed and renamed into place, and then recorded in the
manifest. When the server is unreachable the client waits for it (the restart
policy may be bringing it back) instead of burning the samples' retries.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pipeline.config import RUN_ENV
from pipeline.errors import UserError
from pipeline.extract import dataset as ds
from pipeline.extract import fastparse
from pipeline.extract.options import ClientOptions
from pipeline.extract.parse_worker import ParseWorker, WorkerDied
from pipeline.extract.preflight import Plan, fetch_info, plan
from pipeline.extract.progress_line import ProgressLine
from pipeline.extract.response import BadResponse
from pipeline.extract.storing import LAYER_CONVENTION, DiskError, Stored, StoreSpec, store_answer
from pipeline.extract.writer import DTYPES, remove_temp_files, sample_path
from pipeline.layout import HIDDEN_DIR
from pipeline.manifest import MANIFEST_NAME, Manifest, mass_line, summarize
from pipeline.observe.probes.client_state import StateServer
from pipeline.prepare import read_meta as read_prepare_meta
from pipeline.verdict import fmt_bytes


@dataclass
class Options(ClientOptions):
    """`eagle3 extract` arguments."""

    mode: str = "inline"
    layers: int | None = None
    target_topk: int | None = None
    dtype: str = "bf16"
    dump_field: str = "hidden_states_path"
    parser: str = "fast"  # "json": json.loads for every answer (the slow path, kept to compare against)
    max_inflight_gb: float | None = None  # None: a quarter of the memory available at start
    parse_workers: int | None = None  # processes that parse and write; 0: threads in the client; None: cores - 1


def default_parse_workers() -> int:
    """One parse worker per core the client may use, less one for the client's own request loop."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(0, cores - 1)


STORE_WORKERS = 4
# An answer in memory: its JSON text (read into a growing buffer: up to 1/8 spare), then float32
# rows, the bf16 tensor and the chunk being parsed.
PARSED_BYTES_PER_FLOAT = 10.0
JSON_BYTES_PER_FLOAT = 22.0  # until the first answer measures it (`.tolist()` of float32: ~20)
STOP_DRAIN_S = 60.0  # after SIGTERM, how long requests and writes in flight may take to finish


@dataclass
class _Job:
    """One sample on its way through requesting and storing."""

    idx: int
    ids: list[int]
    sid: str | None
    loss_mask: list[int] | None = None
    reserved: float = 0.0  # bytes of the in-flight budget this sample holds
    attempts: int = 0
    truncated_once: bool = False
    last_error: str = ""
    latency_s: float | None = None  # the last answered request's own seconds (the ETA's cost shape)


@dataclass
class _Work:
    """One run's state, made when it starts (`Extractor.run`): what was prepared, the queues between requesting
    and storing, and how many samples are where."""

    data: ds.Dataset
    plan: Plan
    manifest: Manifest
    spec: StoreSpec
    progress: ProgressLine
    remaining: int  # samples not yet recorded, done or failed
    answers: asyncio.Queue  # (job, answer) pairs received, for the store workers (bounded: 2 × concurrency)
    jobs: asyncio.Queue = field(default_factory=asyncio.Queue)  # samples read, waiting for a request slot
    inflight: int = 0  # requests outstanding
    storing: int = 0  # answers received and not yet recorded
    writing: int = 0  # writes running in a thread (never interrupted: always waited for)
    freed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) when budget is given back
    workers: list[ParseWorker] = field(default_factory=list)  # the parse worker processes


def _manifest_error(what: str, out: Path, exc: sqlite3.Error) -> DiskError:
    """The one-line error for a manifest write that failed; a full disk is named as the file writes name it."""
    said = str(exc)
    if "disk is full" in said or "disk I/O" in said:
        said = f"No space left on device (sqlite: {said})"
    return DiskError(f"{what} in {out / 'manifest.sqlite'}: {said}; free space or fix permissions, then run the same "
                     "command to resume")


class Extractor:
    """One extraction run over a dataset."""

    work: _Work  # the run's state, from `run()` on

    def __init__(self, opts: Options, *, log=sys.stderr, on_request=None) -> None:
        self.o, self.log = opts, log
        self.on_request = on_request  # called with (+1 | -1, monotonic time) around each request
        self.stopping = asyncio.Event()
        self.server_up = asyncio.Event()
        self.server_up.set()
        self.width: int | None = None
        self.fatal: Exception | None = None
        self.hidden_recorded = False
        self.unrecorded: set[int] = set()  # samples handed to a parse worker and not yet in the manifest
        self.json_bpf = JSON_BYTES_PER_FLOAT
        if opts.parser == "fast" and not fastparse.available():
            self.say("warning: pysimdjson is not installed: answers are parsed with json.loads, ~8× slower "
                     "(pip install pysimdjson)")
            opts.parser = "json"
        self.budget = self._budget()
        self.n_workers = default_parse_workers() if opts.parse_workers is None else opts.parse_workers
        if self.n_workers < 0:
            raise UserError(f"--parse-workers {self.n_workers}: give 0 (parse in the client's threads) or a number "
                            "of processes, e.g. 3")
        self.inflight_bytes = 0.0
        self.warned_large: set[int] = set()
        self._published = 0.0
        # self.work, the run's state, is made by `run()` (the class's annotation: absent before)
        # what `eagle3 why extract` is told (pipeline/observe/probes/client_state.py): sample -> (sent at, tokens, worker pid)
        self.requests: dict[int, tuple[float, int, int | None]] = {}
        self.beat = time.time()  # the event loop's last turn
        self.last_written: tuple[int, float] | None = None  # (sample, when)

    def _budget(self) -> float:
        if self.o.max_inflight_gb is not None:
            if self.o.max_inflight_gb <= 0:
                raise UserError(f"--max-inflight-gb {self.o.max_inflight_gb}: give a positive size in GB, e.g. 4")
            return self.o.max_inflight_gb * 1e9
        import psutil

        return psutil.virtual_memory().available / 4

    # --- setup --------------------------------------------------------------------
    def prepare(self) -> tuple[ds.Dataset, Plan, Manifest, list[int]]:
        data = ds.scan(self.o.data)
        # A used --out is claimed first (another dataset is refused before any wait for the server, and no earlier
        # run's figures are shown as this run's meanwhile); a new one only once the server passed its preflight.
        manifest = self._claim(data) if (Path(self.o.out) / MANIFEST_NAME).exists() else None
        longest = max(data.tokens, default=0)
        try:
            p = plan(fetch_info(self.o.server, wait_s=self.o.server_wait_s, say=self.say), layers=self.o.layers,
                     topk=self.o.target_topk, longest=longest)
        except BaseException:
            if manifest is not None:
                manifest.close()
            raise
        manifest = manifest or self._claim(data)
        self.say(f"server {self.o.server}: version {p.version}, {p.layers} layers per row "
                 f"({'3 aux + final' if p.final_present else '3 aux, no final; top-' + str(p.topk) + ' target logprobs'}), "
                 f"chunked prefill {p.chunk}, aux layer ids {p.layer_ids}")
        self.say(f"in-flight memory budget {fmt_bytes(self.budget)}"
                 + (" (a quarter of the memory available now; --max-inflight-gb to change)"
                    if self.o.max_inflight_gb is None else "")
                 + ": a request is sent only when its answer fits beside those in flight")
        for w in p.warnings:
            self.say(f"warning: {w}")
        (self.o.out / "hidden_states").mkdir(parents=True, exist_ok=True)
        removed = remove_temp_files(self.o.out / "hidden_states")
        if removed:
            self.say(f"removed {removed} temp file(s) left by an interrupted run")
        manifest.set_meta({"model": p.model, "layers": p.layers, "layer_ids": json.dumps(p.layer_ids),
                           "layer_convention": LAYER_CONVENTION, "final_layer": "present" if p.final_present else "absent",
                           "final_slot": "post-norm" if p.final_present else "", "server_version": p.version,
                           "max_inflight_bytes": int(self.budget), "inflight_bytes": 0})
        prepared = read_prepare_meta(Path(self.o.data))
        if prepared is not None:  # `eagle3 prepare` wrote the data: its template, tokenizer and counts
            manifest.set_meta({"prepared": json.dumps(prepared, sort_keys=True)})
        done = manifest.done()
        missing = [i for i in done if not sample_path(self.o.out, i).exists()]
        if missing:
            self.say(f"{len(missing)} sample(s) recorded done have no file; extracting them again")
            manifest.forget(missing)
        again = set(missing)
        todo = [i for i in range(len(data)) if i not in done or i in again]
        if len(todo) < len(data):
            self.say(f"resuming: {len(data) - len(todo):,} of {len(data):,} samples already done")
        return data, p, manifest, todo

    def _claim(self, data: ds.Dataset) -> Manifest:
        """Open the manifest and make it this data's (by each line's content) and this run's: refused without
        --force when it holds another dataset, with what --force would keep and redo."""
        manifest = Manifest(self.o.out)
        meta = manifest.meta()
        same = meta.get("dataset_sha256") in (None, data.sha256)
        matched = manifest.reconcile(data.keys, same_data=same)
        if not same and not self.o.force:
            manifest.close()
            raise UserError(f"{self.o.out}: holds extraction of a different dataset (hash {meta['dataset_sha256'][:12]}…, "
                            f"this one {data.sha256[:12]}…). --force would continue into it by content: "
                            f"{matched.describe()}. Or use another --out")
        if matched.changes:
            if not same:
                self.say(f"--force: {self.o.out} held another version of this data; by each line's content: "
                         f"{matched.describe()}")
            manifest.apply(matched, lambda i: sample_path(self.o.out, i))
        # the data's, and this run's from now on (before waiting for the server): the service reads no earlier
        # run's figures as this run's, and a rerun after a failed wait resumes into this data without --force
        manifest.set_meta({"dataset_sha256": data.sha256, "samples_total": len(data), "tokens_total": data.tokens_total,
                           "tokens_sq_total": sum(n * n for n in data.tokens),
                           "data_path": str(Path(self.o.data).resolve()),
                           **({"run": os.environ[RUN_ENV]} if os.environ.get(RUN_ENV) else {})})
        return manifest

    def say(self, text: str) -> None:
        print(f"extract: {text}", file=self.log, flush=True)

    # --- the run --------------------------------------------------------------------
    async def run(self) -> int:
        """Request workers keep `concurrency` requests outstanding; store workers decode, validate
        and write in threads, so storage latency never holds a request slot."""
        data, p, manifest, todo = self.prepare()
        if "hidden_size" in manifest.meta():
            self.width = int(manifest.meta()["hidden_size"]) * p.layers
            self.hidden_recorded = True
        self.work = _Work(
            data=data, plan=p, manifest=manifest, remaining=len(todo),
            spec=StoreSpec(out=self.o.out, mode=self.o.mode, parser=self.o.parser, dtype=self.o.dtype,
                           dump_field=self.o.dump_field, plan=p),
            progress=ProgressLine(total=len(data), done=len(data) - len(todo), log=self.log,
                                  tokens_total=data.tokens_total, tokens_left=sum(data.tokens[i] for i in todo),
                                  tokens_sq_left=sum(data.tokens[i] ** 2 for i in todo)),
            answers=asyncio.Queue(maxsize=2 * self.o.concurrency))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        limits = httpx.Limits(max_connections=self.o.concurrency, max_keepalive_connections=self.o.concurrency)
        n = self.n_workers
        self.say(f"requesting, parsing and writing in {n} worker process(es)" + (" (one per core, less one for "
                 "the client; --parse-workers to change)" if self.o.parse_workers is None else "") if n else
                 f"parsing and writing in {STORE_WORKERS} threads of the client (--parse-workers 0)")
        told = StateServer(os.getpid(), self.snapshot)
        try:
            self.work.workers += [self._start_worker() for _ in range(n)]
            with open(self.o.data, "rb") as fh:
                async with httpx.AsyncClient(base_url=self.o.server, timeout=self.o.timeout_s, limits=limits) as client:
                    tasks = [asyncio.create_task(self._feed(fh, todo)), asyncio.create_task(self._beat())]
                    tasks += [asyncio.create_task(self._requester(client)) for _ in range(self.o.concurrency)]
                    if not self.work.workers:
                        tasks += [asyncio.create_task(self._storer()) for _ in range(STORE_WORKERS)]
                    await self._until_finished()
                    await end_tasks(tasks)
        finally:
            told.close()
            for w in self.work.workers:
                w.close()
            if self.work.workers:
                self._drop_uncounted()
        try:
            manifest.set_meta({"inflight_bytes": 0})
        except sqlite3.Error as exc:  # a full disk: the run's own error says so, not this bookkeeping's
            self.fatal = self.fatal or _manifest_error("cannot update the manifest", self.o.out, exc)
        manifest.close()
        self.work.progress.final()
        try:
            mass = mass_line(summarize(self.o.out))
        except (OSError, sqlite3.Error):
            mass = None
        if mass:
            self.say(mass)
        if self.fatal:
            raise UserError(str(self.fatal))
        if self.stopping.is_set():
            self.say("stopped on request; the manifest is consistent — run the same command to resume")
        return 0

    async def _beat(self) -> None:
        """The event loop's heartbeat, for the state told on request: a loop blocked in a read stops it."""
        while True:
            self.beat = time.time()
            await asyncio.sleep(0.5)

    def snapshot(self) -> dict:
        """The client's state now, for `eagle3 why extract` (read from the state thread: copies only)."""
        w = getattr(self, "work", None)  # asked before the run began: no work yet
        requests = dict(self.requests)  # one C-level copy: atomic against the loop's changes
        workers = list(w.workers) if w else []
        return {
            "pid": os.getpid(), "t": time.time(), "loop_beat": self.beat,
            "in_flight": [{"sample": i, "since": t, "tokens": n, "worker": pid}
                          for i, (t, n, pid) in sorted(requests.items(), key=lambda kv: kv[1][0])],
            "waiting": w.jobs.qsize() if w else 0, "storing": w.storing if w else 0,
            "budget_bytes": self.budget, "inflight_bytes": self.inflight_bytes,
            "server_up": self.server_up.is_set(), "stopping": self.stopping.is_set(),
            "remaining": w.remaining if w else None,
            "last_written": {"sample": self.last_written[0], "t": self.last_written[1]} if self.last_written else None,
            "workers": [{"pid": pw.pid, "requests": len(pw.pending), "exit": pw.proc.poll()} for pw in workers],
        }

    async def _until_finished(self) -> None:
        """All samples recorded; or a fatal error; or, after a stop, the work in flight drained
        (bounded by STOP_DRAIN_S: what is still in flight then is abandoned, not recorded).
        A write already in a thread cannot be interrupted, so it is always waited for and recorded:
        cancelling its task instead would leave a complete file the manifest does not count."""
        drain_deadline = None
        while True:
            if not self.work.remaining or self.fatal is not None:
                ended = True
            elif self.stopping.is_set():
                drain_deadline = drain_deadline or time.monotonic() + STOP_DRAIN_S
                ended = (not self.work.inflight and not self.work.storing) or time.monotonic() > drain_deadline
            else:
                ended = False
            if ended and not self.work.writing:
                return
            await asyncio.sleep(0.05)

    def _ending(self) -> bool:
        return self.stopping.is_set() or self.fatal is not None

    def _stop(self) -> None:
        if not self.stopping.is_set():
            self.say("stop requested: finishing the samples in flight, taking no new ones")
        self.stopping.set()

    async def _feed(self, fh, todo: list[int]) -> None:
        """Read data lines lazily, keeping a short queue ahead of the requesters."""
        for idx in todo:
            while self.work.jobs.qsize() >= 2 * self.o.concurrency and not self._ending():
                await asyncio.sleep(0.005)
            if self._ending():
                return
            if idx in self.work.data.errors:
                self._finish(_Job(idx, [], None), "failed", error=self.work.data.errors[idx])
                continue
            ids, sid, mask = self.work.data.read_sample(fh, idx)
            self.work.jobs.put_nowait(_Job(idx, ids, sid, mask))

    async def _requester(self, client) -> None:
        while True:
            job = await self.work.jobs.get()
            if self._ending():
                continue  # abandoned: not recorded, so it is extracted on resume
            await self._wait_for_server(client)
            if self._ending() or not await self._admit(job):
                continue
            if self._ending():  # the run ended while this sample waited for room in the budget
                self._release(job)
                continue
            if self.work.workers:
                await self._through_worker(job)
                continue
            job.attempts += 1
            self.work.inflight += 1
            try:
                content = await self._send(client, job)
            except httpx.TransportError as exc:
                self._release(job)
                job.attempts -= 1  # an unreachable server is not this sample's fault
                job.last_error = _http_reason(exc)
                self.server_up.clear()
                self.work.jobs.put_nowait(job)
                continue
            except httpx.HTTPStatusError as exc:
                self._release(job)
                self._retry(job, _http_reason(exc), retryable=True)
                continue
            except Exception as exc:  # noqa: BLE001 - a dead worker must end the run, not hang it
                self._release(job)
                self.fatal = UserError(f"unexpected error requesting sample {job.idx}: {type(exc).__name__}: {exc}")
                return
            finally:
                self.work.inflight -= 1
            self.work.storing += 1
            await self.work.answers.put((job, content))
            del content  # else this worker keeps its last answer alive while it waits for the next

    def _drop_uncounted(self) -> None:
        """Once the workers are reaped: remove what they wrote for samples the manifest does not count (in
        flight when a fatal error ended the run), so no file is mistaken for a counted one."""
        for idx in self.unrecorded:
            sample_path(self.o.out, idx).unlink(missing_ok=True)
        remove_temp_files(self.o.out / HIDDEN_DIR)

    async def _through_worker(self, job: _Job) -> None:
        """One admitted sample, requested, stored and written by the least busy parse worker."""
        w = min(self.work.workers, key=lambda w: len(w.pending))
        self.unrecorded.add(job.idx)
        job.attempts += 1
        self.work.inflight += 1
        self.requests[job.idx] = (time.time(), len(job.ids), w.pid)
        if self.on_request:
            self.on_request(+1, time.monotonic())
        try:
            reply = await w.request(idx=job.idx, body=self._body(job), sid=job.sid, loss_mask=job.loss_mask,
                                    width=self.width)
        except WorkerDied as exc:
            self._release(job)
            self._replace(w, str(exc))
            self._retry(job, str(exc), retryable=True)
            return
        finally:
            self.work.inflight -= 1
            self.requests.pop(job.idx, None)
            if self.on_request:
                self.on_request(-1, time.monotonic())
        self._release(job)
        job.latency_s = reply.get("latency_s")
        if "transport" in reply:  # an unreachable server is not this sample's fault
            job.attempts -= 1
            job.last_error = reply["transport"]
            self.server_up.clear()
            self.work.jobs.put_nowait(job)
        elif "http" in reply:
            self._retry(job, reply["http"], retryable=True)
        elif "ok" in reply:
            self._stored(job, Stored(**reply["ok"]))
        elif "bad" in reply:
            self._retry(job, reply["bad"], retryable=reply["retry"])
        elif "disk" in reply:
            self.fatal = DiskError(reply["disk"])
        else:
            self.fatal = UserError(f"unexpected error storing sample {job.idx}: WorkerError: "
                                   f"{reply.get('error', repr(reply)[:300])}; the manifest is consistent — please "
                                   "report this, then rerun to resume")

    def _replace(self, w: ParseWorker, reason: str) -> None:
        """A dead worker gives way to a new one (once, however many samples it held)."""
        if w not in self.work.workers or self._ending():
            return
        k = self.work.workers.index(w)
        self.work.workers[k] = self._start_worker()
        w.close(timeout_s=1.0)
        self.say(f"warning: {reason}; started another (pid {self.work.workers[k].pid}), its samples are tried again")

    def _body(self, job: _Job) -> dict:
        body = {"input_ids": job.ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_hidden_states": True}
        if self.work.plan.topk:
            body.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=self.work.plan.topk)
        return body

    def _predict(self, job: _Job) -> float:
        """The bytes this sample's answer will take in memory; the whole budget before the row width
        is known (the first answer runs alone and measures it)."""
        if not self.width:
            return self.budget
        return len(job.ids) * self.width * (self.json_bpf * 1.125 + PARSED_BYTES_PER_FLOAT)

    async def _admit(self, job: _Job) -> bool:
        """Wait until the sample's answer fits in the budget beside those in flight (or nothing is in
        flight: a sample larger than the whole budget runs alone). False when the run is ending."""
        while True:
            need = self._predict(job)  # again after each wait: the first answer may have given the width
            if not self.inflight_bytes or self.inflight_bytes + need <= self.budget:
                break
            if self._ending():
                self.work.jobs.put_nowait(job)
                return False
            await wait_at_most(self.work.freed, 0.5)
        self.inflight_bytes += need
        job.reserved = need
        if need > self.budget and self.width and job.idx not in self.warned_large:
            self.warned_large.add(job.idx)
            self.say(f"warning: sample {job.idx} ({len(job.ids):,} tokens) needs about {fmt_bytes(need)} in "
                     f"memory, more than the {fmt_bytes(self.budget)} budget: it runs alone")
        return True

    def _release(self, job: _Job) -> None:
        """Give the sample's share of the budget back and wake the waiters (no await: nothing can
        run between a sample's end and its accounting)."""
        if not job.reserved:
            return
        self.inflight_bytes = max(0.0, self.inflight_bytes - job.reserved)
        job.reserved = 0.0
        freed, self.work.freed = self.work.freed, asyncio.Event()
        freed.set()

    async def _send(self, client, job: _Job) -> bytearray:
        body = self._body(job)
        if self.on_request:
            self.on_request(+1, time.monotonic())
        t0 = time.monotonic()
        self.requests[job.idx] = (time.time(), len(job.ids), None)
        try:
            async with client.stream("POST", "/generate", json=body) as r:
                if r.status_code >= 400:
                    await r.aread()
                    r.raise_for_status()
                content = bytearray()  # grown in place: never the chunk list and its join at once
                async for chunk in r.aiter_bytes():
                    content += chunk
            job.latency_s = time.monotonic() - t0
        finally:
            self.requests.pop(job.idx, None)
            if self.on_request:
                self.on_request(-1, time.monotonic())
        return content

    async def _storer(self) -> None:
        """Take answers and store them in a thread."""
        while True:
            job, content = await self.work.answers.get()
            box = [content]  # _store takes the answer out of the box, so its memory goes when it is parsed
            del content
            if self.fatal is not None:
                box.clear()
                self._release(job)
                self.work.storing -= 1
                continue  # abandoned: not recorded, so it is extracted on resume
            self.work.writing += 1
            try:
                fields = {"idx": job.idx, "ids": job.ids, "sid": job.sid, "loss_mask": job.loss_mask,
                          "width": self.width}
                try:
                    stored = await asyncio.to_thread(store_answer, self.work.spec, box, **fields)
                finally:
                    self.work.writing -= 1
                    box.clear()
                    self._release(job)
                self._stored(job, stored)
            except BadResponse as exc:
                self._retry(job, exc.reason, retryable=exc.retry)
            except DiskError as exc:
                self.fatal = exc
            except Exception as exc:  # noqa: BLE001 - a dead worker must end the run, not hang it
                self.fatal = UserError(f"unexpected error storing sample {job.idx}: {type(exc).__name__}: {exc}; "
                                       "the manifest is consistent — please report this, then rerun to resume")
            finally:
                self.work.storing -= 1

    def _retry(self, job: _Job, reason: str, *, retryable: bool) -> None:
        job.last_error = reason
        if not retryable:
            # Chunked-prefill truncation is deterministic: one retry confirms it.
            if job.truncated_once or "chunked prefill" not in reason:
                return self._finish(job, "failed", error=reason)
            job.truncated_once = True
        if job.attempts > self.o.max_retries:
            return self._finish(job, "failed", error=reason)

        async def later() -> None:
            await asyncio.sleep(min(30.0, 0.5 * 2 ** (job.attempts - 1)))
            self.work.jobs.put_nowait(job)

        asyncio.get_running_loop().create_task(later())

    def _finish(self, job: _Job, status: str, *, nbytes: int | None = None, error: str | None = None,
                topk_mass: float | None = None) -> None:
        tokens = len(job.ids) if job.ids else None
        try:
            self.work.manifest.record(idx=job.idx, sample_id=job.sid, status=status, tokens=tokens, nbytes=nbytes,
                                 attempts=job.attempts, error=None if error is None else error[:500],
                                 now=time.time(), latency_s=job.latency_s if status == "done" else None,
                                 line_hash=self.work.data.keys[job.idx], topk_mass=topk_mass)
        except sqlite3.Error as exc:
            if status == "done":  # a file the manifest cannot count must not stay to be mistaken for one
                sample_path(self.o.out, job.idx).unlink(missing_ok=True)
            self.fatal = self.fatal or _manifest_error(f"cannot record sample {job.idx}", self.o.out, exc)
            return
        self.unrecorded.discard(job.idx)
        if status == "done":
            self.last_written = (job.idx, time.time())
        if status == "done" and self.width and not self.hidden_recorded:
            try:
                self.work.manifest.set_meta({"hidden_size": self.width // self.work.plan.layers})
                self.hidden_recorded = True
            except sqlite3.Error as exc:  # tried again with the next sample; a full disk ends the run, named
                self.fatal = self.fatal or _manifest_error("cannot record the hidden size", self.o.out, exc)
        self.work.remaining -= 1
        self.work.progress.add(ok=status == "done", tokens=tokens or 0,
                          latency_s=job.latency_s if status == "done" else None)
        if time.monotonic() - self._published > 2.0:  # for `eagle3 status`: bytes in flight, now and then
            self._published = time.monotonic()
            try:
                self.work.manifest.set_meta({"inflight_bytes": int(self.inflight_bytes)})
            except sqlite3.Error:
                pass

    def _stored(self, job: _Job, stored: Stored) -> None:
        """A sample's file is written: learn the row width and the answer's size a float, record it."""
        if self.o.mode != "dump":
            self.json_bpf = max(self.json_bpf if self.width else 0.0,
                                stored.answer_bytes / max(1, len(job.ids) * stored.width))
        self.width = self.width or stored.width
        self._finish(job, "done", nbytes=stored.nbytes, topk_mass=stored.topk_mass)

    def _start_worker(self) -> ParseWorker:
        slots = -(-self.o.concurrency // max(1, self.n_workers))  # the requests in flight, shared out
        return ParseWorker(self.work.spec, server=self.o.server, timeout_s=self.o.timeout_s, slots=slots)


    async def _wait_for_server(self, client) -> None:
        if self.server_up.is_set():
            return
        deadline = time.monotonic() + self.o.server_wait_s
        while time.monotonic() < deadline and not self.stopping.is_set():
            try:
                if (await client.get("/health", timeout=5.0)).status_code == 200:
                    self.server_up.set()
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
        if not self.stopping.is_set():
            self.fatal = UserError(f"server {self.o.server} unreachable for {self.o.server_wait_s:.0f} s; "
                                   "the manifest is consistent — restart the server and rerun to resume")


async def wait_at_most(event: asyncio.Event, seconds: float) -> None:
    """Wait for the event or the time, whichever comes first, and let a cancellation through.
    Python 3.11's `asyncio.wait_for` returns normally when the task is cancelled in the same loop
    iteration as the event is set (the budget given back by a storer that is being cancelled):
    the cancellation is lost and the requester goes on to wait for a job that never comes."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        pass


async def end_tasks(tasks: list[asyncio.Task], *, grace_s: float = 1.0) -> None:
    """Cancel the workers and wait until each has ended, cancelling again any that is still running
    after `grace_s` (a cancellation swallowed by a library must not hang the run's end)."""
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    for t in tasks:  # retrieve the outcomes, so that none is logged as "never retrieved"
        if not t.cancelled():
            t.exception()


def _http_reason(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"server answered HTTP {exc.response.status_code}: {exc.response.text[:200]}"
    return f"{type(exc).__name__}: {exc}"


def extract(opts: Options) -> int:
    """Run an extraction to its end (or a requested stop)."""
    if opts.dtype not in DTYPES:
        raise UserError(f"--dtype {opts.dtype}: choose one of {', '.join(DTYPES)}")
    if not Path(opts.data).is_file():
        raise UserError(f"--data {opts.data}: no such file")
    return asyncio.run(Extractor(opts).run())
