"""The `eagle3` command line: a thin loop over controller verbs.

Each command imports what it runs inside its own function, so that a command starts with its own work
only: `eagle3 status` and the detached stage runner (`run-stage`) do not load the replay, the trainer's
export or the data preparation (measured: importing them all at the top costs every start 55 ms more).
These are the product's only imports inside functions that defer no third-party dependency
(`tests/unit/test_layers.py`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import DEFAULT_CONFIG_NAME, STAGE_NAMES, load_workspace
from pipeline.errors import UserError


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, an example, its arguments (or a function that adds them), its handler."""

    help: str
    example: str
    args: tuple | Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}  # iterated by the parser and the docs test


def arg(*flags: str, **kwargs) -> tuple[tuple[str, ...], dict]:
    """One argument of a command, as `argparse.add_argument` takes it."""
    return flags, kwargs


def required(**flags: str) -> tuple:
    """Required arguments, each with its help: required(server="…", data="…") → --server, --data."""
    return tuple(arg("--" + name.replace("_", "-"), required=True, help=text) for name, text in flags.items())


# Shared arguments, declared once (sqlite-utils' shared option decorators): the commands that talk to the target
SERVER = arg("--server", required=True, metavar="URL",
             help="the target's SGLang base URL, e.g. http://127.0.0.1:30000")


def command(name: str, help_text: str, *, example: str, args=()):
    """Register a subcommand handler with its one-line help, an example and its arguments."""
    def deco(fn):
        COMMANDS[name] = Command(help_text, example, args, fn)
        return fn
    return deco


def toy_server_arguments(parser: argparse.ArgumentParser) -> None:
    """`toy-server`'s flags live with the toy server, free of torch so that the CLI starts fast."""
    from pipeline.toy.args import add_arguments
    add_arguments(parser)


def _controller(args):
    from pipeline.controller import Controller
    return Controller.open(args.config)


@command("init", "write a commented production config template, or --demo a runnable toy workspace",
         example="eagle3 init /srv/eagle3   |   eagle3 init --demo /tmp/e3demo",
         args=(arg("dir", nargs="?", help="directory to write eagle3.toml into (default: .)"),
               arg("--demo", action="store_true", help="a runnable toy pipeline (toy server, extraction, CPU training)")))
def cmd_init(args) -> int:
    from pipeline.templates import production_template
    target = Path(args.dir or ".") / DEFAULT_CONFIG_NAME
    if target.exists():
        raise UserError(f"{target}: already exists; not overwriting it (edit it, or init another directory)")
    target.parent.mkdir(parents=True, exist_ok=True)
    if args.demo:
        from pipeline.toy.demo_workspace import write_demo_workspace
        write_demo_workspace(target.parent)
        print(f"wrote a toy workspace in {target.parent}: eagle3 --config {target} start server; start extract; "
              "autostart on; serve")
        return 0
    target.write_text(production_template())
    print(f"wrote {target}; fill in the <PLACEHOLDERS>, then `eagle3 check-config {target}`")
    return 0


@command("check-config", "validate a config file without touching any state (every problem, one line each)",
         example="eagle3 check-config /srv/eagle3/eagle3.toml",
         args=(arg("file", nargs="?", help="config to check (default: the usual lookup)"),
               arg("--service-path", metavar="PATH", default=None,
                   help="PATH stage commands are looked up on (default: systemd's, "
                        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)")))
def cmd_check_config(args) -> int:
    from pipeline.config import find_config
    from pipeline.configcheck import problems
    path = Path(args.file) if args.file else find_config(args.config)
    ws = load_workspace(path)
    found = problems(ws, path_env=args.service_path)
    for line in found:
        print(f"eagle3: {line}", file=sys.stderr)
    if found:
        print(f"eagle3: {path}: {len(found)} problem(s); fix them and run `eagle3 check-config` again", file=sys.stderr)
        return 2
    print(f"{path}: ok (state in {ws.state_dir})")
    return 0


@command("start", "start a stage under a detached runner (training only once extraction is verified complete)",
         example="eagle3 start extract",
         args=(arg("stage", choices=STAGE_NAMES),
               arg("--force", action="store_true",
                   help="start training although extraction is not verified complete (audited)"),
               arg("--fresh", action="store_true",
                   help="training only: start over at step 1; the earlier training's checkpoints, progress and draft "
                        "are moved to OUT/previous/<time>/ (without it, training resumes from its checkpoint)")))
def cmd_start(args) -> int:
    from handlers.render.views import server_holds_gpus_text, train_guard_text
    from pipeline.controller import ServerHoldsGpusError, TrainGuardError
    with _controller(args) as ctl:
        try:
            proc = ctl.start(args.stage, force=args.force, fresh=args.fresh, by=_who())
        except TrainGuardError as exc:
            raise UserError(train_guard_text(exc.completion)) from None
        except ServerHoldsGpusError as exc:
            raise UserError(server_holds_gpus_text(exc)) from None
    from pipeline.states import StageState
    if not proc.launched:
        raise UserError(f"{args.stage} did not start: {proc.reason}; see `eagle3 logs {args.stage}`")
    if proc.set_aside:
        print(f"moved the earlier training's files to {proc.set_aside}")
    if proc.reopened:
        print(f"no run was open: training on run {proc.reopened}'s verified extraction (run {proc.reopened} reopened)")
    print(f"started {args.stage}: {proc.who}, run {proc.run_id}, log {proc.log}")
    if proc.state == StageState.QUEUED:
        print(f"{args.stage} is {proc.reason}")
    elif proc.state != StageState.RUNNING:
        print(f"{args.stage} has already ended ({proc.reason}); see `eagle3 logs {args.stage}`")
    return 0


@command("autostart", "on: train by itself once extraction is verified complete; off: cancel (until launch)",
         example="eagle3 autostart on",
         args=(arg("state", choices=("on", "off")),))
def cmd_autostart(args) -> int:
    from handlers.render.views import autostart_text
    with _controller(args) as ctl:
        result = ctl.autostart(args.state == "on", by=_who())
    if result.refused:
        raise UserError(autostart_text(result))
    print(autostart_text(result))
    return 0


@command("remind", "check back later: a reminder with the status after 30m, 1h, … or at the extraction ETA",
         example="eagle3 remind 1h   |   eagle3 remind eta",
         args=(arg("when", help="30m, 1h, 90s … or eta"),))
def cmd_remind(args) -> int:
    from handlers.render.views import clock_time
    with _controller(args) as ctl:
        r = ctl.remind(args.when, by=_who())
    note = "" if r["monitor_running"] else " (no monitor is running: start `eagle3 serve` so it is delivered)"
    print(f"reminder set for {clock_time(r['due_at'])}{note}")
    return 0


def _who() -> str:
    """Who runs this command, for the audit: the person behind `sudo -u eagle3` (SUDO_USER), else the
    login name, else the account's name."""
    return f"cli:{cli_user(os.environ, os.getuid())}"


def cli_user(env, uid: int) -> str:
    """SUDO_USER (the person, under the guide's `sudo -u eagle3` alias), USER, LOGNAME, or uid's account name."""
    name = env.get("SUDO_USER") or env.get("USER") or env.get("LOGNAME")
    if name:
        return name
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@command("stop", "stop a stage (or --all): SIGTERM to its process group, grace, SIGKILL",
         example="eagle3 stop extract --grace 60   |   eagle3 stop --all",
         args=(arg("stage", nargs="?", choices=STAGE_NAMES),
               arg("--all", action="store_true", help="stop every stage and close the run"),
               arg("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL")))
def cmd_stop(args) -> int:
    from handlers.render.views import stop_text
    if not args.all and not args.stage:
        raise UserError("stop: name a stage (server, extract, train) or pass --all")
    with _controller(args) as ctl:
        results = (ctl.stop_all(grace_s=args.grace, by=_who()) if args.all
                   else [ctl.stop(args.stage, grace_s=args.grace, by=_who())])
    for result in results:
        print(stop_text(result))
    return 1 if any(r.survivors for r in results) else 0


@command("status", "run id and each stage's state, pid, uptime, exit code, log",
         example="eagle3 status --json | jq .stages.extract.eta_s",
         args=(arg("--json", action="store_true", help="one JSON object"),))
def cmd_status(args) -> int:
    from handlers.render.views import status_text
    with _controller(args) as ctl:
        status = ctl.status()
    print(json.dumps(status.to_json()) if args.json else status_text(status))
    return 0


@command("logs", "print the last lines of a stage's log",
         example="eagle3 logs extract -n 200",
         args=(arg("stage", choices=STAGE_NAMES),
               arg("-n", type=int, default=50, help="lines to show (default 50)")))
def cmd_logs(args) -> int:
    with _controller(args) as ctl:
        path, lines = ctl.logs(args.stage, lines=args.n, on_node=True)
    if not lines:
        print(f"{args.stage}: no output yet in {path}", file=sys.stderr)
    for line in lines:
        print(line)
    return 0


@command("why", "where a stage is: its processes' Python stacks (py-spy), the server's own view, its log's end",
         example="eagle3 why train --native",
         args=(arg("stage", choices=STAGE_NAMES),
               arg("--native", action="store_true",
                   help="native (C/C++) frames too: py-spy pauses each process for the milliseconds it reads; "
                        "without it, the stacks are read without pausing anything")))
def cmd_why(args) -> int:
    with _controller(args) as ctl:
        ev, path = ctl.why(args.stage, native=args.native)
    print(ev.text())
    print(f"kept in {path}" if isinstance(path, Path) else path)
    return 0


def probe_arguments(parser: argparse.ArgumentParser) -> None:
    """`probe`'s flags live with the probe (`python -m pipeline.observe.nodeprobe`, the same program)."""
    from pipeline.observe.nodeprobe import add_arguments
    add_arguments(parser)


@command("probe", "internal: a Slurm job's processes, GPUs and files on this node, as one JSON line",
         example="(run by the monitor on a job's nodes through `srun --overlap`, not by hand)",
         args=probe_arguments)
def cmd_probe(args) -> int:
    from pipeline.observe.nodeprobe import main
    return main(args)



@command("run-stage", "internal: the detached runner that owns one stage process",
         example="(started by `eagle3 start`, not by hand)",
         args=(arg("--stage", required=True, choices=STAGE_NAMES),
               arg("--proc-id", required=True, type=int)))
def cmd_run_stage(args) -> int:
    from pipeline.config import find_config
    from pipeline.stages.runner import run_stage
    return run_stage(ws=load_workspace(find_config(args.config)), stage=args.stage, proc_id=args.proc_id)


@command("serve", "run the monitor, the handoff and the Slack app until stopped; stages keep running",
         example="eagle3 serve   |   eagle3 serve --http --port 3000 --metrics-port 9464",
         args=(arg("--max-ticks", type=int, default=None, help="exit after N ticks (scripts, tests)"),
               arg("--http", action="store_true", help="serve Slack's HTTP events at /slack/events (signed)"),
               arg("--port", type=int, default=3000, help="port for --http (default 3000; 0: any)"),
               arg("--host", default="127.0.0.1", help="address for --http (default 127.0.0.1)"),
               arg("--metrics-port", type=int, default=None, metavar="P",
                   help="serve Prometheus metrics at http://[metrics] host:P/metrics (0: any free port)"),
               arg("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="eagle3's own log level (default info); debug also shows the libraries' logs")))
def cmd_serve(args) -> int:
    import logging

    from bot.service import serve
    from pipeline.config import find_config
    configure_logging(getattr(logging, args.log_level.upper()))
    return serve(load_workspace(find_config(args.config)), max_ticks=args.max_ticks,
                 http_port=args.port if args.http else None, host=args.host, metrics_port=args.metrics_port)


LIBRARY_LOGGERS = ("apscheduler", "slack_bolt", "slack_sdk", "httpx", "httpcore", "urllib3")


def configure_logging(level: int) -> None:
    """serve's logging: eagle3's own at `level`; the libraries at WARNING unless debug is asked for (httpx
    alone logs every probe request at INFO: about 17,000 journal lines a day at the default tick)."""
    import logging

    logging.basicConfig(level=min(level, logging.WARNING), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    logging.getLogger("eagle3").setLevel(level)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if level <= logging.DEBUG else logging.WARNING)
    if level > logging.DEBUG:  # an outage of Slack: the same error once per window, with how many were held back
        for handler in logging.getLogger().handlers:
            handler.addFilter(OncePerWindow(prefixes=("slack_sdk", "slack_bolt")))


class OncePerWindow:
    """A logging filter: a library's record (by logger and message, digits aside) passes once per `window_s`;
    the next one to pass says how many like it were held back. slack_sdk logs each failed retry at ERROR (12 a
    minute during an outage); the outbox already keeps the count and the last error for `eagle3 status`."""

    def __init__(self, *, prefixes: tuple[str, ...], window_s: float = 300.0, clock=None) -> None:
        import time

        self.prefixes, self.window_s, self.clock = prefixes, window_s, clock or time.monotonic
        self.seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record) -> bool:
        import re

        if not record.name.startswith(self.prefixes):
            return True
        key = (record.name, re.sub(r"\d+", "#", str(record.msg))[:120])
        now = self.clock()
        last, held = self.seen.get(key, (None, 0))
        if last is not None and now - last < self.window_s:
            self.seen[key] = (last, held + 1)
            return False
        self.seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the last {self.window_s / 60:.0f} min held back)"
        return True


@command("diagnose", "verdicts: of the live workspace, or --replay a recorded observation trace",
         example="eagle3 diagnose --replay incident.jsonl --json",
         args=(arg("--replay", metavar="FILE", help="observation JSONL to replay ('-' for stdin)"),
               arg("--json", action="store_true", help="one JSON object per processed line")))
def cmd_diagnose(args) -> int:
    if args.replay:
        return _replay(args)
    from handlers.render.views import run_label, verdict_line
    with _controller(args) as ctl:
        status = ctl.status()
    if args.json:  # each stage's verdict as the replay's lines carry it, with its run
        print(json.dumps({name: {"run": st.run, "state": st.state, "verdict": st.verdict,
                                 "stuck": st.verdict in ("stalled", "dead") if st.verdict else None,
                                 "progress_pct": st.progress_pct, "eta_s": st.eta_s, "eta_low_s": st.eta_low_s,
                                 "eta_high_s": st.eta_high_s, "reasons": list(st.reasons)}
                          for name, st in status.stages.items()}))
        return 0
    for name, st in status.stages.items():
        print(f"{name}{run_label(st, status.run)}: {st.state}" + ("\n" + verdict_line(name, st) if st.started else ""))
    return 0


def _replay(args) -> int:
    from handlers.render.views import replay_timeline_line
    from pipeline.observe.replay import replay
    try:
        fh = sys.stdin if args.replay == "-" else open(args.replay, encoding="utf-8", errors="replace")  # noqa: SIM115
    except OSError as exc:
        raise UserError(f"{args.replay}: cannot read the trace ({exc.strerror}); check the path") from None
    processed, last = 0, dict[str, str]()
    with fh:
        for item in replay(fh):
            if item.skipped:
                print(f"eagle3: {args.replay}:{item.lineno}: skipped: {item.skipped}", file=sys.stderr)
                continue
            v = item.verdict
            if v is None:  # (a skipped line has no verdict: said above)
                continue
            processed += 1
            if args.json:
                print(json.dumps(v.replay_json(), separators=(",", ":")))
            elif last.get(v.stage) != v.verdict:
                print(replay_timeline_line(v))
            last[v.stage] = v.verdict
    if not processed:
        print(f"eagle3: {args.replay}: no observation could be processed", file=sys.stderr)
        return 2
    return 0


@command("export-trace", "write stored observations as JSONL (the replay format)",
         example="eagle3 export-trace --stage extract --since 2026-12-04T08:00 --out trace.jsonl",
         args=(arg("--stage", choices=STAGE_NAMES),
               arg("--since", help="unix seconds or ISO 8601"),
               arg("--out", help="file to write (default: stdout)")))
def cmd_export_trace(args) -> int:
    from pipeline.timeparse import parse_time
    since = parse_time(args.since) if args.since else None
    import contextlib

    sink = open(args.out, "w", encoding="utf-8") if args.out else contextlib.nullcontext(sys.stdout)  # noqa: SIM115
    count = 0
    with _controller(args) as ctl, sink as out:
        for obs in ctl.store.observations(stage=args.stage, since=since):
            out.write(json.dumps(obs, separators=(",", ":")) + "\n")
            count += 1
    if args.out:
        print(f"wrote {count} observations to {args.out}")
    return 0


@command("extract", "extract hidden states from an SGLang server into OUT (resumable)",
         example="eagle3 extract --server http://127.0.0.1:30000 --data train.jsonl --out /data/hs",
         args=(SERVER,
               *required(data="JSONL, one sample a line with input_ids and an optional id",
                         out="output directory (hidden_states/ and manifest.sqlite)"),
               arg("--concurrency", type=int, default=32, help="requests in flight (default 32)"),
               arg("--max-retries", type=int, default=3, help="retries of a sample with a bad answer (default 3)"),
               arg("--mode", choices=("inline", "dump"), default="inline"),
               arg("--layers", type=int, help="layers per returned row (default: from /server_info)"),
               arg("--target-topk", type=int, help="top-K target logprobs when the final layer is absent (default 256: the mass it captures is "
                        "recorded per sample and shown)"),
               arg("--dtype", default="bf16", help="bf16 (default), fp16 or fp32"),
               arg("--dump-field", default="hidden_states_path", help="dump mode: meta_info field naming the file"),
               arg("--server-wait", type=float, default=600.0, help="seconds to wait for an unreachable server"),
               arg("--force", action="store_true", help="continue into an OUT made from another dataset"),
               arg("--parse-workers", type=int, metavar="N",
                   help="processes that request, parse, check and write the samples, so that extraction is not capped "
                        "at one core (default: cores - 1; 0: threads inside the client)"),
               arg("--max-inflight-gb", type=float, metavar="G",
                   help="memory for answers in flight: a request waits until its answer fits (default: a quarter of "
                        "the memory available at start)"),
               arg("--parser", choices=("fast", "json"), default="fast",
                   help="fast (default): hidden states parsed by simdjson into arrays; json: json.loads (slow)")))
def cmd_extract(args) -> int:
    from pipeline.extract.client import Options, extract
    return extract(Options(server=args.server, data=Path(args.data), out=Path(args.out), concurrency=args.concurrency,
                           max_retries=args.max_retries, mode=args.mode, layers=args.layers,
                           target_topk=args.target_topk, dtype=args.dtype, dump_field=args.dump_field,
                           server_wait_s=args.server_wait, force=args.force, parser=args.parser,
                           max_inflight_gb=args.max_inflight_gb, parse_workers=args.parse_workers))


@command("prepare", "a chat dataset (ShareGPT or messages) rendered with the target's chat template, loss mask on the "
                    "assistant's tokens only: the extraction's input",
         example="eagle3 prepare --target-model /models/Llama-3.1-8B-Instruct --data sharegpt.jsonl --out train.jsonl",
         args=(arg("--target-model", required=True, metavar="DIR",
                   help="the target's Hugging Face directory: its tokenizer and chat template (read locally)"),
               arg("--data", required=True, help="JSONL: ShareGPT 'conversations' or OpenAI-style 'messages' "
                                                 "(tool turns, tool_calls, a line's 'tools', reasoning_content)"),
               arg("--out", required=True, help="JSONL to write (atomically): id, input_ids, loss_mask; and "
                                                "OUT.meta.json beside it"),
               arg("--format", choices=("sharegpt", "messages", "auto"), default="auto",
                   help="input format (default auto: per line)"),
               arg("--max-length", type=int, help="cut conversations to this many tokens (counted)"),
               arg("--system", metavar="TEXT", help="a system prompt for conversations that have none"),
               arg("--trust-remote-code", action="store_true",
                   help="allow the model's own tokenizer code (Kimi's tiktoken tokenizer needs it)"),
               arg("--show", type=int, default=0, metavar="K",
                   help="print the first K conversations' tokens, those trained on in ⟦…⟧"),
               arg("--drop-reasoning", action="store_true",
                   help="leave out assistant turns' reasoning_content (default: kept where the template renders it, "
                        "and trained on as the assistant's own tokens)")))
def cmd_prepare(args) -> int:
    from pipeline.prepare import prepare
    if args.max_length is not None and args.max_length < 2:
        raise UserError(f"--max-length {args.max_length}: must be at least 2")
    prepare(target_model=args.target_model, data=Path(args.data), out=Path(args.out), fmt=args.format,
            max_length=args.max_length, system=args.system, trust_remote_code=args.trust_remote_code, show=args.show,
            reasoning=not args.drop_reasoning)
    return 0


@command("regenerate", "every assistant turn of a prepared dataset answered again by the target (SGLang /generate on "
                       "token ids), resumable; the extraction's input",
         example="eagle3 regenerate --server http://127.0.0.1:30000 --data train.jsonl --out regen.jsonl",
         args=(SERVER,
               *required(data="eagle3 prepare's output: id, input_ids, loss_mask",
                         out="JSONL to write once every conversation is done (OUT.parts/ holds the manifest and the "
                             "finished ones meanwhile)"),
               arg("--max-new-tokens", type=int, default=4096, help="longest answer per turn (default 4096)"),
               arg("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7, as SpecForge's)"),
               arg("--concurrency", type=int, default=16, help="conversations in flight (default 16)"),
               arg("--max-retries", type=int, default=3, help="retries of a failed request (default 3)"),
               arg("--server-wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for a server that is still starting"),
               arg("--target-model", metavar="DIR",
                   help="re-render each turn's history through this target's chat template, as serving does (the "
                        "conversations come from the chat file eagle3 prepare read; earlier reasoning is dropped where "
                        "the template drops it); default: the earlier turns go back as the tokens generated"),
               arg("--trust-remote-code", action="store_true", help="with --target-model: allow the model's own "
                                                                    "tokenizer code"),
               arg("--eot-id", type=int, action="append", metavar="ID",
                   help="an end-of-turn token id the answers stop at (repeatable; default: those eagle3 prepare read "
                        "off the chat template, in DATA's .meta.json)"),
               arg("--force", action="store_true", help="continue into OUT.parts/ of another dataset")))
def cmd_regenerate(args) -> int:
    from pipeline.regenerate import Options, regenerate
    return regenerate(Options(server=args.server, data=Path(args.data), out=Path(args.out),
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              concurrency=args.concurrency, max_retries=args.max_retries,
                              server_wait_s=args.server_wait, force=args.force, eot_ids=args.eot_id,
                              target_model=args.target_model, trust_remote_code=args.trust_remote_code))


@command("verify", "open random extracted files and check keys, shapes, token ids and finiteness",
         example="eagle3 verify /data/hs --sample 500",
         args=(arg("out", help="extraction output directory"),
               arg("--sample", type=int, default=200, help="files to open (default 200)")))
def cmd_verify(args) -> int:
    from pipeline.extract.verify import describe, verify
    res = verify(Path(args.out), sample=args.sample)
    print(describe(res, Path(args.out)))
    for problem in res.problems[:50]:
        print(f"  {problem}")
    return 0 if res.ok and res.checked else 2


@command("toy-server", "a tiny SGLang-compatible target on loopback (demo, tests, benchmarks)",
         example="eagle3 toy-server --port 30000",
         args=toy_server_arguments)
def cmd_toy_server(args) -> int:
    from pipeline.toy.server import serve as toy_serve
    return toy_serve(args)


@command("train", "the EAGLE-3 draft trainer itself (run it under torchrun); same flags as python -m pipeline.train",
         example="eagle3 train --data /data/hs --target-model /models/Llama-3.1-8B-Instruct --out ckpt --steps 2000",
         args=())
def cmd_train(args) -> int:
    from pipeline.train.loop import main as train_main
    return train_main(args.passthrough, prog="eagle3 train", epilog=f"Example: {COMMANDS['train'].example}")


PASSTHROUGH = frozenset({"train"})  # commands whose flags (and --help) are another program's: passed on whole


@command("chart", "draw a stage's run as a PNG: progress with the ETA band, rates, loss, GPUs (UTC)",
         example="eagle3 chart extract --out extract.png",
         args=(arg("stage", choices=STAGE_NAMES),
               arg("--run", help="run id (default: the current run)"),
               arg("--out", required=True, help="PNG file to write")))
def cmd_chart(args) -> int:
    from pipeline.observe.charts import render_run
    with _controller(args) as ctl:
        out, count, run = render_run(ctl.store, args.stage, out=Path(args.out), run=args.run)
    if out is None:
        raise UserError(f"chart: no observations of {args.stage}" + (f" in run {run}" if run else "") +
                        "; is `eagle3 serve` running?")
    print(f"wrote {out} ({count} observations)")
    return 0


@command("export", "write a training checkpoint as SGLang's EAGLE-3 draft directory (config.json + model.safetensors)",
         example="eagle3 export ckpt --out ckpt/draft",
         args=(arg("checkpoint", help="a training --out directory (its latest checkpoint) or checkpoints/step_N"),
               arg("--out", required=True, help="directory to write (replaced atomically)"),
               arg("--with-embeddings", metavar="TARGET_DIR",
                   help="also write the target's embedding (SGLang swaps the target's in without it)"),
               arg("--served-context", type=int, metavar="N",
                   help="the context length the target is served at (default: its max_position_embeddings): a "
                        "warning when it is longer than the draft was trained on")))
def cmd_export(args) -> int:
    from pipeline.train.export import context_warning, export_checkpoint, launch_line, tp_line
    out = export_checkpoint(Path(args.checkpoint), Path(args.out),
                            with_embeddings=Path(args.with_embeddings) if args.with_embeddings else None)
    print(f"wrote {out} (LlamaForCausalLMEagle3; checked against SGLang's load rules); {tp_line(out)}")
    warning = context_warning(out, served_context=args.served_context)
    if warning:
        print(warning)
    print(f"serve it with: {launch_line(out, args.with_embeddings or 'TARGET_MODEL')}")
    return 0


@command("eval-draft", "acceptance length τ of an exported draft against the target's greedy continuations",
         example="eagle3 eval-draft --draft ckpt/draft --server http://127.0.0.1:30000 --data prompts.jsonl --depth 5",
         args=(*required(draft="an exported draft directory (eagle3 export, or the trainer's OUT/draft)"), SERVER,
               *required(data="JSONL of prompts (input_ids); half learn the bigram baseline"),
               arg("--target-model", metavar="DIR",
                   help="the target's HF directory (its embedding), unless the draft was exported --with-embeddings"),
               arg("--depth", type=int, default=5, help="draft tokens per round, --speculative-num-steps (default 5)"),
               arg("--prompts", type=int, default=64, help="prompts to read (default 64)"),
               arg("--new-tokens", type=int, default=96, help="greedy continuation length (default 96)"),
               arg("--json", action="store_true", help="one JSON object")))
def cmd_eval_draft(args) -> int:
    from pipeline.evaluate import main as eval_main
    return eval_main(args)


@command("demo", "the whole story in a temporary toy workspace: extraction, auto-start, training, summary",
         example="eagle3 demo   |   eagle3 demo --slack-channel C0123456",
         args=(arg("--slack-channel", metavar="C…",
                   help="post to this Slack channel instead of printing to the console (needs SLACK_BOT_TOKEN; default: "
                        "the console transport)"),
               arg("--regenerate", action="store_true",
                   help="begin with a regeneration stage: the toy target answers the conversations' assistant turns "
                        "again, and auto-start starts extraction of them")))
def cmd_demo(args) -> int:
    from bot.demo import run_demo
    return run_demo(slack_channel=args.slack_channel, regenerate=args.regenerate)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; --config is accepted before or after the subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS,
                        help="config file (default: $EAGLE3_CONFIG, then ./eagle3.toml)")
    parser = argparse.ArgumentParser(prog="eagle3", parents=[common],
                                     description="Operate an EAGLE-3 draft-model training pipeline.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, spec in COMMANDS.items():
        cmd = sub.add_parser(name, parents=[] if name in PASSTHROUGH else [common], help=spec.help,
                             description=spec.help, add_help=name not in PASSTHROUGH,
                             epilog=f"Example: {spec.example}", formatter_class=argparse.RawDescriptionHelpFormatter)
        if callable(spec.args):
            spec.args(cmd)
        else:
            for flags, kwargs in spec.args:
                cmd.add_argument(*flags, **kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `eagle3` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in PASSTHROUGH:
        args.passthrough = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not args.command:
        parser.print_help()
        return 2
    args.config = getattr(args, "config", None)
    try:
        return COMMANDS[args.command].handler(args)
    except UserError as exc:
        print(f"eagle3: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("eagle3: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `eagle3 status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except Exception as exc:  # noqa: BLE001 - the user gets one line, never a traceback
        if os.environ.get("EAGLE3_DEBUG"):
            traceback.print_exc()
        print(f"eagle3: unexpected error in {args.command}: {type(exc).__name__}: {exc} "
              "(set EAGLE3_DEBUG=1 to see the traceback, and please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
