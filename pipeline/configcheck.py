"""`eagle3 check-config`: what a config that parses can still get wrong, one line each.

Parsing (pipeline.config) catches types and unknown keys. These checks catch what only
shows hours later: a placeholder left in, a channel *name* where Slack wants its id, a
port that disagrees with the URL, an `out` the command does not write to, a dataset
that is not there, a command the service cannot find on its own PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from urllib.parse import urlparse

from pipeline import manifest
from pipeline.config import PLACEHOLDER, RUN_TOKEN, STAGE_NAMES, Workspace
from pipeline.stages import slurm

# systemd's PATH for system services: what a stage started by `eagle3 serve` under the unit sees.
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CHANNEL_ID = re.compile(r"[CGD][A-Z0-9]{6,}")
USER_ID = re.compile(r"[UW][A-Z0-9]{6,}")


def placeholders(ws: Workspace) -> list[str]:
    """Every setting that still holds a template <PLACEHOLDER>, as 'file: key: …' lines."""
    found = []
    for key, text in _leaves(ws.config.model_dump()):
        hit = PLACEHOLDER.search(text)
        if hit:
            found.append(f"{ws.path.name}: {key}: still holds the placeholder {hit.group(0)}; replace it")
    return found


def problems(ws: Workspace, *, path_env: str | None = None) -> list[str]:
    """All problems of a parsed config. `path_env`: the PATH stage commands are looked up on
    (default: systemd's PATH for services, unless a stage sets its own in `env`)."""
    out = placeholders(ws)
    out += _slack_ids(ws)
    out += _server_port(ws)
    out += _paths_agree(ws)
    out += _data_exists(ws)
    out += _commands(ws, path_env or SERVICE_PATH)
    out += slurm_problems(ws)
    out += _state_on_local_disk(ws)
    return out


def _state_on_local_disk(ws: Workspace) -> list[str]:
    """The store uses SQLite's WAL mode, which needs every process using it on one host: not on NFS."""
    where = ws.state_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    if not manifest.shared_across_hosts(where):
        return []
    kind = manifest.filesystem_type(where) or "a filesystem"
    return [f"{ws.path.name}: state.dir: {ws.state_dir} is on {kind}, shared across hosts; the store needs a local "
            'disk (SQLite WAL): set [state] dir = "/var/lib/eagle3/<run>" or another local path']


def slurm_problems(ws: Workspace) -> list[str]:
    """For stages with executor = "slurm": Slurm's client commands here and a controller that answers."""
    stages = [s for s in STAGE_NAMES if ws.stage(s).on_slurm]
    if not stages:
        return []
    where = f"{ws.path.name}: stages.{stages[0]}.executor"
    missing = slurm.missing_commands()
    if missing:
        return [f'{where}: "slurm" needs Slurm\'s client commands on this host; not on PATH: {", ".join(missing)} '
                "(install slurm-client, or run the stage with executor = \"local\")"]
    why = slurm.ping()
    return [f"{where}: {why}; check SLURM_CONF and that slurmctld runs"] if why else []


def _leaves(value: object, key: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{key}[{i}]")
    elif isinstance(value, str):
        yield key, value


def _slack_ids(ws: Workspace) -> list[str]:
    slack, name, out = ws.config.slack, ws.path.name, []
    checks = [("slack.channel", [slack.channel] if slack.channel else [], CHANNEL_ID, "a channel id such as C0123456789",
               "channel details → About, at the bottom"),
              ("slack.allowed_channel_ids", slack.allowed_channel_ids, CHANNEL_ID, "channel ids such as C0123456789",
               "channel details → About, at the bottom"),
              ("slack.allowed_user_ids", slack.allowed_user_ids, USER_ID, "member ids such as U0123456789",
               "a person's profile → ⋮ → Copy member ID"),
              ("slack.oncall_user_ids", slack.oncall_user_ids, USER_ID, "member ids such as U0123456789",
               "a person's profile → ⋮ → Copy member ID")]
    for key, values, pattern, wanted, where in checks:
        for value in values:
            if PLACEHOLDER.search(value) or pattern.fullmatch(value):
                continue
            out.append(f'{name}: {key}: "{value}" is not a Slack id; Slack wants {wanted} ({where})')
    return out


def _flag(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _server_port(ws: Workspace) -> list[str]:
    server, name = ws.config.stages.server, ws.path.name
    url = urlparse(server.url)
    url_port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    out = []
    if url_port != server.port:
        out.append(f"{name}: stages.server.port: {server.port}, but stages.server.url ({server.url}) points at port "
                   f"{url_port}; make them the same port")
    argv_port = _flag(server.argv, "--port")
    if argv_port and not PLACEHOLDER.search(argv_port) and argv_port != str(server.port):
        out.append(f"{name}: stages.server.argv: the server is started with --port {argv_port}, but "
                   f"stages.server.port is {server.port}; make them the same port")
    return out


def _paths_agree(ws: Workspace) -> list[str]:
    """`out`/`data` are what the monitor reads; the argv is what the stage writes: one place."""
    out, name = [], ws.path.name
    pairs = [("extract", "out", "--out"), ("extract", "data", "--data"), ("train", "out", "--out")]
    for stage, key, flag in pairs:
        cfg = ws.stage(stage)
        configured, given = getattr(cfg, key), _flag(cfg.argv, flag)
        if configured is None or given is None or PLACEHOLDER.search(configured + given):
            continue
        if _resolved(ws, stage, given) != ws.resolve(configured):
            out.append(f'{name}: stages.{stage}.{key}: "{configured}", but the command is given {flag} "{given}"; '
                       f"the monitor would watch a different place than the stage writes: make them the same path")
    return out


def _resolved(ws: Workspace, stage: str, value: str) -> Path:
    p = Path(os.path.expanduser(value))
    base = ws.resolve(ws.stage(stage).cwd) or ws.root
    return p if p.is_absolute() else base / p


def _data_exists(ws: Workspace) -> list[str]:
    """The extraction's dataset exists, unless a stage before it writes it (regeneration's `out`) or it is a
    run's own (`{run}`: made in each run)."""
    data, regenerated = ws.config.stages.extract.data, ws.config.stages.regenerate
    if not data or PLACEHOLDER.search(data) or RUN_TOKEN in data or ws.resolve(data).is_file():
        return []
    if regenerated.argv and regenerated.out and ws.resolve(regenerated.out) == ws.resolve(data):
        return []
    return [f'{ws.path.name}: stages.extract.data: "{data}" does not exist ({ws.resolve(data)}); '
            "give the dataset JSONL (one sample a line with input_ids)"]


def _commands(ws: Workspace, path_env: str) -> list[str]:
    out = []
    for stage in STAGE_NAMES:
        cfg = ws.stage(stage)
        if not cfg.argv or PLACEHOLDER.search(cfg.argv[0]) or cfg.on_slurm:
            continue  # a job's command is looked up on its compute node, not here
        why = command_problem(cfg.argv[0], cwd=ws.resolve(cfg.cwd) or ws.root, path_env=cfg.env.get("PATH", path_env))
        if why:
            out.append(f"{ws.path.name}: stages.{stage}.argv[0]: {why}")
    return out


def command_problem(program: str, *, cwd: Path, path_env: str) -> str | None:
    """Why `program` cannot be started from `cwd` with PATH `path_env`, or None."""
    if "/" in program:
        p = Path(os.path.expanduser(program))
        p = p if p.is_absolute() else cwd / p
        if not p.is_file():
            return f'"{program}" does not exist; give the absolute path of the program'
        if not os.access(p, os.X_OK):
            return f'"{program}" is not executable; chmod +x it or give the right program'
        return None
    if shutil.which(program, path=path_env):
        return None
    here = Path(sys.executable).parent / program
    hint = f", e.g. {here}" if here.is_file() else ""
    return (f'"{program}" is not on the service\'s PATH ({path_env}); give its absolute path{hint} '
            "(a venv's bin is not on a service's PATH)")
