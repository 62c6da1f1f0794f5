"""`eagle3 regenerate`: every assistant turn of a prepared dataset answered again by the target itself,
so the draft learns the target's distribution and not the dataset's.

Input: `eagle3 prepare`'s lines ({"id", "input_ids", "loss_mask"}). Each run of loss_mask 1 is an assistant
turn, ending with its end-of-turn token; the tokens before it are the conversation so far and the template's
generation prompt. For each turn in order, the target gets (what it has generated so far for the earlier
turns) + (the original tokens up to the turn) through SGLang's `/generate` on token ids, with the template's
end-of-turn tokens as stop tokens, and its answer replaces the turn. The stop tokens are read off the chat
template by `eagle3 prepare` (its OUT.meta.json), never taken from the turn's own last token: a turn that
prepare's --max-length cut ends on ordinary content, and is answered again in full. They are carried into
this OUT.meta.json. The answer's tokens are trained on; an answer that reaches `--max-new-tokens` is closed
with the end-of-turn token (not trained on, not the target's) so the conversation keeps its shape, and
counted.

With `--target-model DIR`, each turn's history is rendered through the target's chat template instead, as
serving (and SpecForge's regeneration through the chat endpoint) builds it: the conversations come from the
chat file `prepare` read (its sidecar names it), the target's earlier answers go back as messages (a leading
<think>…</think> as their reasoning), so a template that drops earlier reasoning once a later question
follows (Qwen3's, Kimi's thinking templates) drops it here too; the finished conversation is prepared again
with the template. Without it, the earlier turns go back as the tokens generated.

Resumable and exact like the extraction: `OUT.parts/` holds `manifest.sqlite` (the same table as the
extraction's: a row per sample, done or failed) and one small JSON file per finished sample
(`lines/<idx>.json`, fsync-ed before its row is written). A restart — after kill -9 too — redoes only what
has no row, nothing is written twice, and `OUT` itself is written once, atomically, in input order, when
every sample has a row. The monitor reads `OUT.parts/manifest.sqlite` for progress and ETA and
`OUT.parts/lines/` for the new-file rate, as for the extraction.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import sys
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import httpx

from pipeline.config import RUN_ENV
from pipeline.errors import UserError
from pipeline.extract.dataset import scan
from pipeline.extract.options import ClientOptions
from pipeline.extract.preflight import fetch_info
from pipeline.layout import lines_dir, parts_dir
from pipeline.manifest import Manifest, read_done, summarize
from pipeline.prepare import LineError, Renderer, load_tokenizer, meta_path_of, read_meta, turns_of

PROGRESS_EVERY_S = 5.0


@dataclass
class Options(ClientOptions):
    """`eagle3 regenerate` arguments (fewer requests in flight than the extraction's: each is a whole answer)."""

    max_new_tokens: int = 4096
    temperature: float = 0.7
    concurrency: int = 16
    timeout_s: float = 900.0
    server_wait_s: float = 0.0
    eot_ids: list[int] | None = None  # the end-of-turn tokens (default: those `prepare` read off the template)
    target_model: str | None = None  # with it: each turn's history re-rendered through the chat template
    trust_remote_code: bool = False


class TurnError(Exception):
    """This sample cannot be regenerated (recorded as failed with the reason)."""


def assistant_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class Regenerator:
    def __init__(self, o: Options, *, say=None) -> None:
        self.o = o
        self.say = say or (lambda m: print(f"regenerate: {m}", file=sys.stderr, flush=True))
        self.client = httpx.Client(timeout=o.timeout_s, limits=httpx.Limits(max_connections=o.concurrency + 2))
        self.stop = threading.Event()
        self.cut_turns = 0
        self.eot_ids: list[int] = list(o.eot_ids or [])
        self.lock = threading.Lock()
        self.chats: ChatSource | None = None  # --target-model: the conversations, re-rendered turn by turn

    # --- one sample -----------------------------------------------------------------------------------
    def generate(self, prompt: list[int]) -> tuple[list[int], bool]:
        """The target's answer to `prompt`, ending with an end-of-turn token ((tokens, whether it stopped by
        itself))."""
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": self.o.max_new_tokens,
                                                         "temperature": self.o.temperature,
                                                         "stop_token_ids": list(self.eot_ids)}}
        last = None
        for attempt in range(self.o.max_retries + 1):
            if self.stop.is_set():
                raise InterruptedError
            try:
                r = self.client.post(f"{self.o.server.rstrip('/')}/generate", json=body)
                if r.status_code >= 500 or r.status_code == 429:
                    raise httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
                if r.status_code != 200:
                    raise TurnError(f"/generate answered HTTP {r.status_code}: {r.text[:200]}")
                out = r.json().get("output_ids")
                if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
                    raise TurnError("/generate answered without output_ids")
                return self._closed(out)
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError) as exc:
                last = exc
                time.sleep(min(8.0, 0.5 * 2 ** attempt))
        raise TurnError(f"/generate failed {self.o.max_retries + 1} times ({type(last).__name__}: {last})")

    def _closed(self, out: list[int]) -> tuple[list[int], bool]:
        at = next((i for i, t in enumerate(out) if t in self.eot_ids), None)
        if at is not None:  # SGLang includes the matched stop token (finished_len = its position + 1)
            return out[: at + 1], True
        return out, False

    def regenerate(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        """A sample's tokens and loss mask with every assistant turn the target's own."""
        runs = assistant_runs(mask)
        if not runs:
            raise TurnError("no loss_mask 1 anywhere: no assistant turn to regenerate (prepare it with eagle3 prepare)")
        new_ids, new_mask, cursor = [], [], 0
        for start, end in runs:
            # the turn's own last token is no stop token: a turn prepare's --max-length cut ends on ordinary
            # content; the target answers it again in full, stopping only at the template's end of turn
            new_ids += ids[cursor:start]
            new_mask += [0] * (start - cursor)
            answer, stopped = self.generate(new_ids)
            new_ids += answer
            new_mask += [1] * len(answer)
            if not stopped:  # cut at --max-new-tokens: closed so the conversation keeps its shape
                new_ids.append(self.eot_ids[0])
                new_mask.append(0)
                with self.lock:
                    self.cut_turns += 1
            cursor = end
        new_ids += ids[cursor:]
        new_mask += [0] * (len(ids) - cursor)
        return new_ids, new_mask

    # --- the run --------------------------------------------------------------------------------------
    def run(self) -> int:
        o = self.o
        if not o.data.is_file():
            raise UserError(f"--data {o.data}: no such file")

        data = scan(o.data)
        parts = parts_dir(o.out)
        lines_dir(o.out).mkdir(parents=True, exist_ok=True)
        manifest = Manifest(parts)
        meta = manifest.meta()
        same = meta.get("dataset_sha256") in (None, data.sha256)
        matched = manifest.reconcile(data.keys, same_data=same)
        if not same and not o.force:
            manifest.close()
            raise UserError(f"{parts}: holds a regeneration of another dataset. --force would continue into it by "
                            f"content: {matched.describe()}. Or use another --out")
        if matched.changes:
            if not same:
                self.say(f"--force: {parts} held another version of this data; by each line's content: "
                         f"{matched.describe()}")
            manifest.apply(matched, lambda i: lines_dir(o.out) / f"{i}.json")
        manifest.set_meta({"dataset_sha256": data.sha256, "samples_total": len(data), "tokens_total": data.tokens_total,
                           "tokens_sq_total": sum(n * n for n in data.tokens), "data_path": str(o.data.resolve()),
                           **({"run": os.environ[RUN_ENV]} if os.environ.get(RUN_ENV) else {}),
                           "stage": "regenerate", "max_new_tokens": o.max_new_tokens, "temperature": o.temperature})
        self._end_of_turn(data)
        if o.target_model:
            self.chats = ChatSource(o, say=self.say)
        try:  # after the manifest is this run's: an earlier run's figures are not shown while the server is awaited
            fetch_info(o.server, wait_s=o.server_wait_s, say=self.say)
        except BaseException:
            manifest.close()
            raise
        done = manifest.done()
        missing = [i for i in done if not (lines_dir(o.out) / f"{i}.json").exists()]
        if missing:  # a row without its file (a disk swapped under it): do them again
            manifest.forget(missing)
            done -= set(missing)
        recorded = done | {r[0] for r in manifest.conn.execute("SELECT idx FROM samples WHERE status = 'failed'")}
        todo = [i for i in range(len(data)) if i not in done]
        retried = len([i for i in todo if i in recorded])
        self.say(f"{len(data):,} conversations, {len(done):,} already regenerated, {len(todo):,} to do"
                 + (f" ({retried:,} that failed before)" if retried else "")
                 + f"; temperature {o.temperature}, up to {o.max_new_tokens:,} new tokens a turn, "
                   f"{o.concurrency} at a time")
        try:
            self._work(data, todo, manifest)
        finally:
            manifest.close()
            self.client.close()
        return self._finish(data)

    def _end_of_turn(self, data) -> None:
        """The stop tokens: --eot-id, else the end-of-turn ids `eagle3 prepare` read off the template (its
        OUT.meta.json), else inferred from the data — the last token of the turns that more tokens follow (a
        final turn may be one --max-length cut) — and said, since only the template knows for sure."""
        if self.eot_ids:
            self.say(f"stop tokens (end of turn): {self.eot_ids} (--eot-id)")
            return
        meta = read_meta(self.o.data) or {}
        if meta.get("end_of_turn_ids"):
            self.eot_ids = [int(t) for t in meta["end_of_turn_ids"]]
            self.say(f"stop tokens (end of turn): {self.eot_ids}, read off the chat template by eagle3 prepare")
            return
        seen: Counter = Counter()
        with open(self.o.data, "rb") as fh:
            for idx in range(min(len(data), 2000)):
                ids, _, mask = data.read_sample(fh, idx)
                mask = mask or []
                seen.update(ids[end - 1] for _, end in assistant_runs(mask) if end < len(ids))
        if not seen:
            raise UserError(f"--data {self.o.data}: no OUT.meta.json from eagle3 prepare and no turn followed by "
                            "more tokens to read the end-of-turn token from: give it with --eot-id ID")
        self.eot_ids = [seen.most_common(1)[0][0]]
        self.say(f"stop tokens (end of turn): {self.eot_ids}, inferred from the data (no OUT.meta.json from eagle3 "
                 "prepare); give --eot-id to be sure")

    def _work(self, data, todo: list[int], manifest: Manifest) -> None:
        fh = open(self.o.data, "rb")  # noqa: SIM115 - read by this thread only
        pending: dict = {}
        it, last = iter(todo), time.monotonic()
        count = {"done": 0, "failed": 0}
        with ThreadPoolExecutor(max_workers=self.o.concurrency) as pool:
            try:
                while True:
                    while len(pending) < self.o.concurrency:
                        idx = next(it, None)
                        if idx is None:
                            break
                        if idx in data.errors:
                            self._record(manifest, idx, None, "failed", 0, data.errors[idx], 0.0, data.keys[idx])
                            count["failed"] += 1
                            continue
                        ids, sid, mask = data.read_sample(fh, idx)
                        pending[pool.submit(self._one, idx, ids, mask or [], sid)] = (idx, sid, len(ids), time.time())
                    if not pending:
                        break
                    finished, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        idx, sid, n, t0 = pending.pop(fut)
                        try:
                            line = fut.result()
                        except TurnError as exc:
                            self._record(manifest, idx, sid, "failed", n, str(exc), time.time() - t0, data.keys[idx])
                            count["failed"] += 1
                            continue
                        self._write_line(idx, {"id": sid if sid is not None else f"line-{idx}", **line})
                        self._record(manifest, idx, sid, "done", n, None, time.time() - t0, data.keys[idx])
                        count["done"] += 1
                    if time.monotonic() - last >= PROGRESS_EVERY_S:
                        last = time.monotonic()
                        self.say(f"{count['done']:,} regenerated, {count['failed']:,} failed this run, "
                                 f"{len(pending)} in flight")
            except KeyboardInterrupt:
                self.stop.set()
                raise
            finally:
                fh.close()

    def _one(self, idx: int, ids: list[int], mask: list[int], sid: str | None = None) -> dict:
        if self.chats is not None:
            new_ids, new_mask = self.regenerate_chat(sid if sid is not None else f"line-{idx + 1}")
        else:
            new_ids, new_mask = self.regenerate(ids, mask)
        return {"input_ids": new_ids, "loss_mask": new_mask}

    def regenerate_chat(self, sid: str) -> tuple[list[int], list[int]]:
        """A conversation answered again turn by turn as serving sees it: for each assistant turn, the history —
        the earlier turns with the target's own answers — rendered through the chat template (a template that
        drops earlier reasoning drops it here too), its generation prompt, then `/generate`; the whole conversation
        is prepared once more at the end, so its tokens and mask are the template's. An answer cut at
        --max-new-tokens ends the conversation before it (never trained as a finished turn)."""
        chats = self.chats
        if chats is None:
            raise AssertionError("regenerate_chat runs only with --target-model (the chat source)")
        turns, tools = chats.conversation(sid)
        done: list[dict] = []
        for turn in turns:
            if turn["role"] != "assistant":
                done.append(turn)
                continue
            with chats.lock:
                prompt = chats.tok(chats.renderer.render(done, generation_prompt=True, tools=tools),
                                   add_special_tokens=False)["input_ids"]
            answer, stopped = self.generate(list(prompt))
            if not stopped:
                with self.lock:
                    self.cut_turns += 1
                break
            with chats.lock:
                text = chats.tok.decode([t for t in answer if t not in self.eot_ids], skip_special_tokens=False)
            done.append({**_answered(text), **{k: v for k, v in turn.items() if k == "tool_calls"}})
        if not any(t["role"] == "assistant" for t in done):
            raise TurnError("the first answer reached --max-new-tokens: nothing finished to train on")
        try:
            with chats.lock:
                p = chats.renderer.prepare(done, max_length=chats.max_length, tools=tools)
        except LineError as exc:
            raise TurnError(f"the regenerated conversation cannot be prepared: {exc}") from None
        return p.input_ids, p.loss_mask

    def _write_line(self, idx: int, obj: dict) -> None:
        path = lines_dir(self.o.out) / f"{idx}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as fh:
            fh.write(json.dumps(obj))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    @staticmethod
    def _record(manifest, idx, sid, status, tokens, error, latency, key) -> None:
        manifest.record(idx=idx, sample_id=sid, status=status, tokens=tokens, nbytes=None, attempts=1, error=error,
                        now=time.time(), latency_s=latency if status == "done" else None, line_hash=key)

    def _finish(self, data) -> int:
        """Write OUT in input order once every sample has a row (exit 0; the failed ones are named in the manifest
    and counted, and the completion check weighs them); exit 1 when some have no row yet."""
        s = summarize(parts_dir(self.o.out))
        if s["done"] + s["failed"] < len(data):
            self.say(f"stopped with {s['done'] + s['failed']:,} of {len(data):,} done; run it again to go on")
            return 1
        _, done = read_done(parts_dir(self.o.out))
        tmp = self.o.out.with_name(f".{self.o.out.name}.tmp-{os.getpid()}")
        tokens = 0
        with open(tmp, "w") as dst:
            for idx in done:
                line = (lines_dir(self.o.out) / f"{idx}.json").read_text()
                tokens += len(json.loads(line)["input_ids"])
                dst.write(line.rstrip("\n") + "\n")
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.o.out)
        # the input's sidecar carried forward (the extraction records it), with what regeneration used
        meta = {**(read_meta(self.o.data) or {}), "end_of_turn_ids": self.eot_ids, "conversations": s["done"],
                "tokens": tokens, "regenerated": {"source": str(self.o.data.resolve()), "server": self.o.server,
                                                  "temperature": self.o.temperature,
                                                  "max_new_tokens": self.o.max_new_tokens}}
        meta_path = meta_path_of(self.o.out)
        meta_tmp = meta_path.with_name(f".{meta_path.name}.tmp-{os.getpid()}")
        meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(meta_tmp, meta_path)
        cut = f"; {self.cut_turns:,} turn(s) this run reached --max-new-tokens and were closed" if self.cut_turns else ""
        self.say(f"wrote {self.o.out}: {s['done']:,} conversations, {tokens:,} tokens; {s['failed']:,} failed"
                 + (f" (reasons in {parts_dir(self.o.out) / 'manifest.sqlite'})" if s["failed"] else "") + cut)
        return 0  # every conversation has its row: whether the failed ones are few enough is completion's call


THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)


def _answered(text: str) -> dict:
    """The target's answer as an assistant message: a leading <think>…</think> as its reasoning_content (the
    template renders it back where it keeps reasoning), the rest as its content."""
    m = THINK.match(text)
    if m:
        return {"role": "assistant", "content": text[m.end():], "reasoning_content": m.group(1).strip("\n")}
    return {"role": "assistant", "content": text}


class ChatSource:
    """The conversations `eagle3 prepare` rendered (the chat file its sidecar names), by id, with the target's
    tokenizer and chat template: what `regenerate --target-model` re-renders turn by turn."""

    def __init__(self, o: Options, *, say) -> None:
        meta = read_meta(o.data) or {}
        if not meta.get("source"):
            raise UserError(f"--target-model: {o.data} has no OUT.meta.json from eagle3 prepare naming its chat file; "
                            "prepare it with eagle3 prepare, or regenerate without --target-model (on tokens)")
        self.path, self.fmt = Path(meta["source"]), meta.get("format") or "auto"
        self.system, self.max_length = meta.get("system"), meta.get("max_length")
        self.reasoning = not str(meta.get("reasoning", "")).startswith("dropped")
        if not self.path.is_file():
            raise UserError(f"--target-model: the chat file {self.path} that {o.data} was prepared from is gone")
        if not o.target_model:
            raise UserError("--target-model: the target's directory is needed to re-render its chat template")
        self.tok = load_tokenizer(o.target_model, trust_remote_code=o.trust_remote_code)
        self.renderer = Renderer(self.tok)
        self.lock = threading.Lock()  # one tokenizer, many request threads
        self.offsets: dict[str, int] = {}
        with open(self.path, "rb") as fh:
            n, at = 0, 0
            for raw in fh:
                n += 1
                if raw.strip():
                    try:
                        sid = json.loads(raw).get("id", f"line-{n}")
                    except (ValueError, AttributeError):
                        sid = None
                    if sid is not None:
                        self.offsets.setdefault(str(sid), at)
                at += len(raw)
        say(f"re-rendering each turn's history through the chat template of {o.target_model} "
            f"({len(self.offsets):,} conversations in {self.path.name})")

    def conversation(self, sid: str) -> tuple[list[dict], list | None]:
        """The conversation's turns (as prepare read them) and its tools."""
        at = self.offsets.get(sid)
        if at is None:
            raise TurnError(f"conversation {sid} is not in {self.path} (edited since it was prepared?)")
        with open(self.path, "rb") as fh:
            fh.seek(at)
            obj = json.loads(fh.readline())
        try:
            turns = turns_of(obj, self.fmt, reasoning=self.reasoning)
        except LineError as exc:
            raise TurnError(f"conversation {sid}: {exc}") from None
        if self.system is not None and turns[0]["role"] != "system":
            turns = [{"role": "system", "content": self.system}, *turns]
        return turns, obj.get("tools")


def regenerate(o: Options, *, say=None) -> int:
    """Entry point of `eagle3 regenerate`: 0 when every conversation was regenerated and OUT written."""
    if o.concurrency < 1 or o.max_new_tokens < 1 or o.temperature < 0:
        raise UserError("--concurrency and --max-new-tokens must be at least 1, --temperature at least 0")
    return Regenerator(o, say=say).run()


def complete(out: Path, *, max_failed_share: float = 0.0) -> tuple[bool, str]:
    """Whether a regeneration into `out` is verified complete: every sample has a row, at most `max_failed_share`
    of them failed (the handoff's own threshold), and OUT holds one line per done sample; and why not."""
    try:
        s = summarize(parts_dir(out))
    except (OSError, sqlite3.Error) as exc:
        return False, f"no readable manifest ({exc})"
    total = s.get("total")
    if not total or s["done"] + s["failed"] < total:
        return False, f"{s['done'] + s['failed']:,} of {total or '?'} conversations regenerated"
    if s["failed"] > max_failed_share * total:
        return False, (f"{s['failed']:,} conversation(s) failed, more than {100 * max_failed_share:g} % of {total:,}; "
                       "run regenerate again to retry them")
    try:
        with open(out, "rb") as fh:
            lines = sum(1 for _ in fh)
    except OSError:
        return False, f"{out} is not written yet"
    if lines != s["done"]:
        return False, f"{out} holds {lines:,} lines, the manifest {s['done']:,} done"
    failed = f" ({s['failed']:,} failed, within {100 * max_failed_share:g} %)" if s["failed"] else ""
    return True, f"all {total:,} conversations regenerated into {out}{failed}"
