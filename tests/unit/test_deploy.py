"""The deploy kit validates: example config, systemd unit, secrets template, Slack app manifest."""

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from handlers.verbs import SUBCOMMANDS
from pipeline.config import (
    PLACEHOLDER,
    STAGE_NAMES,
    FilesSettings,
    SlurmSettings,
    TensorboardSettings,
    load_workspace,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SECRETS = {"SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "SLACK_SIGNING_SECRET"}


def test_example_config_is_valid_and_complete():
    ws = load_workspace(DEPLOY / "eagle3.example.toml")
    assert not PLACEHOLDER.search((DEPLOY / "eagle3.example.toml").read_text())
    for stage in ("server", "extract", "train"):
        ws.require_filled(stage)
    server = ws.stage("server").argv
    for flag in ("--enable-return-hidden-states", "--enable-return-aux-hidden-states",
                 "--disable-radix-cache", "--chunked-prefill-size"):
        assert flag in server
    assert ws.stage("server").gpus == list(range(8))
    assert ws.stage("train").gpus == [0, 1, 2, 3]
    assert ws.stage("train").argv[1:4] == ["--standalone", "--nproc-per-node", "4"]
    assert "--token-budget" in ws.stage("train").argv
    assert ws.config.slack.channel and ws.config.slack.allowed_user_ids


def test_example_stage_commands_are_the_units_install():
    """Under systemd the PATH holds no venv: the example names the programs the unit's install has."""
    ws = load_workspace(DEPLOY / "eagle3.example.toml")
    bin_dir = Path(unit()["Service"]["ExecStart"].split()[0]).parent
    assert Path(ws.stage("extract").argv[0]) == bin_dir / "eagle3"
    assert Path(ws.stage("train").argv[0]) == bin_dir / "torchrun"


@pytest.mark.parametrize("example", ["eagle3.example.toml", "examples/specforge.toml", "examples/speculators.toml"])
def test_example_config_passes_check_config_where_its_programs_exist(tmp_path, capsys, example):
    """Everything but the host's programs is right: with /opt, /data and /models under tmp and the programs made,
    each example passes — the regenerate layout included, whose extraction data regeneration writes (nothing
    else is created: no dataset file)."""
    from bot.cli import main

    text = (DEPLOY / example).read_text()
    for top in ("/opt/", "/data/", "/models/"):
        text = text.replace(f'"{top}', f'"{tmp_path}{top}')
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(text)
    assert main(["check-config", str(cfg)]) == 2
    missing = capsys.readouterr().err
    assert "does not exist" in missing and "is not a Slack id" not in missing and "port" not in missing
    ws = load_workspace(cfg)
    for stage in STAGE_NAMES:
        if ws.stage(stage).argv:
            program = Path(ws.stage(stage).argv[0])
            program.parent.mkdir(parents=True, exist_ok=True)
            program.write_text("#!/bin/sh\n")
            program.chmod(0o755)
    assert main(["check-config", str(cfg)]) == 0, capsys.readouterr().err


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((DEPLOY / "eagle3.service").read_text())
    return parser


def text_of_unit() -> str:
    return (DEPLOY / "eagle3.service").read_text()


def test_systemd_unit_runs_serve_and_never_kills_the_stages():
    u = unit()
    assert set(u.sections()) == {"Unit", "Service", "Install"}
    service = u["Service"]
    assert re.fullmatch(r"/\S+/eagle3 serve( --\S+ \S+)*", service["ExecStart"])
    assert "--http --port 3000 --host" in text_of_unit(), "the unit shows HTTP mode too"
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "process"
    assert service["OOMPolicy"] == "continue" and service["UMask"] == "0027"  # an OOM-killed rank; the audit rows
    assert u["Unit"]["RequiresMountsFor"].startswith("/")
    assert service["EnvironmentFile"].startswith("/")
    text = (DEPLOY / "eagle3.service").read_text()
    before = text[: text.index("\nKillMode=process")].splitlines()
    why = " ".join(line for line in before[-8:] if line.startswith("#"))  # the comment just above it
    assert "stages" in why and "restart" in why, "the unit says why KillMode=process"
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert not SECRETS & set(text.split("=")), "no secret values in the unit"


def test_systemd_analyze_verifies_the_unit(tmp_path):
    """systemd's own parser accepts every line (an unknown key is only a warning: none may appear). The
    install paths are pointed at this checkout's, which exist here."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this host (Debian: apt-get install systemd)")
    eagle3 = Path(sys.executable).parent / "eagle3"
    text = text_of_unit().replace("/opt/eagle3-ops/.venv/bin/eagle3", str(eagle3))
    (tmp_path / "eagle3.service").write_text(text)
    res = subprocess.run([analyze, "verify", str(tmp_path / "eagle3.service")], capture_output=True, text=True,
                         timeout=60)
    ours = [line for line in (res.stdout + res.stderr).splitlines() if "eagle3.service" in line]
    assert res.returncode == 0 and ours == [], res.stdout + res.stderr


def restarts_after(u: configparser.ConfigParser, status: int) -> bool:
    """Whether systemd restarts the service after `eagle3 serve` exits with `status` (Restart=on-failure:
    any non-zero status, except those in RestartPreventExitStatus)."""
    service = u["Service"]
    assert service["Restart"] == "on-failure"
    prevented = {int(v) for v in service.get("RestartPreventExitStatus", "").split()}
    return status != 0 and status not in prevented


def test_a_config_error_stops_the_unit_instead_of_restarting_it_every_5_s(tmp_path):
    bad = tmp_path / "eagle3.toml"
    bad.write_text("[monitor]\ntick_s = -1\n")
    res = subprocess.run([sys.executable, "-m", "bot.cli", "serve", "--config", str(bad)], capture_output=True,
                         text=True, timeout=60, cwd=DEPLOY.parent)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr  # one journal line: what, where
    assert not restarts_after(unit(), res.returncode), "exit 2 (config) must not restart forever"
    assert restarts_after(unit(), 1), "a crash still restarts"
    assert "KillUserProcesses" in text_of_unit(), "the unit warns that stages started from a shell die at logout"


def test_env_template_names_every_secret_without_values_and_says_mode_600():
    text = (DEPLOY / "eagle3.env.example").read_text()
    assignments = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert set(assignments) == SECRETS
    assert all(v == "" for v in assignments.values()), "the template holds no secret"
    assert "install -m 600" in text


def test_slack_manifest():
    m = yaml.safe_load((DEPLOY / "slack-manifest.yaml").read_text())
    commands = m["features"]["slash_commands"]
    assert [c["command"] for c in commands] == ["/eagle3"]
    for usage in SUBCOMMANDS:
        assert usage.split()[0] in commands[0]["usage_hint"]
    assert sorted(m["oauth_config"]["scopes"]["bot"]) == ["chat:write", "commands", "files:write"]
    assert m["settings"]["interactivity"]["is_enabled"] is True
    assert m["settings"]["socket_mode_enabled"] is True
    assert m["settings"]["event_subscriptions"]["bot_events"] == ["app_home_opened"]
    assert m["features"]["app_home"]["home_tab_enabled"] is True
    assert m["display_information"]["name"] and m["features"]["bot_user"]["display_name"]


def test_the_slurm_example_passes_check_config_against_a_cluster_that_answers(tmp_path, capsys, monkeypatch):
    """With Slurm's client commands on PATH (stand-ins whose `scontrol ping` says UP) and its dataset
    present, the cluster example is ok; its job commands are looked up on the nodes, not here."""
    from bot.cli import main

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"sbatch": "exit 0", "squeue": "exit 0", "scancel": "exit 0",
                       "scontrol": "echo 'Slurmctld(primary) at ctl is UP'"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    text = (DEPLOY / "eagle3.example-slurm.toml").read_text().replace('"/shared/', f'"{tmp_path}/shared/')
    text = text.replace('"/var/lib/eagle3/', f'"{tmp_path}/state/')
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(text)
    ws = load_workspace(cfg)
    assert all(ws.stage(s).on_slurm for s in ("server", "extract", "train"))
    assert isinstance(job := ws.stage("train").executor, SlurmSettings) and job.nodes == 2
    data = Path(ws.config.stages.extract.data)
    data.parent.mkdir(parents=True)
    data.write_text("")
    assert main(["check-config", str(cfg)]) == 0, capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert main(["check-config", str(cfg)]) == 2
    assert "not on PATH: sbatch, squeue, scontrol, scancel" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["specforge", "speculators"])
def test_the_other_tools_examples_load_and_name_their_progress(name):
    """deploy/examples (issue 37): each stage of another tool says where its progress is and what done means."""
    ws = load_workspace(DEPLOY / "examples" / f"{name}.toml")
    extract, train = ws.stage("extract"), ws.stage("train")
    assert isinstance(files := extract.progress, FilesSettings) and files.files_total and extract.files_suffix
    assert isinstance(tb := train.progress, TensorboardSettings) and tb.progress_dir and tb.progress_tag and tb.loss_tag
    assert train.done_when in ("exit0", "exit0-and-total") and (train.done_when == "exit0" or tb.progress_total)
    assert f"deploy/examples/{name}.toml" in (DEPLOY.parent / "docs" / "operator.md").read_text()


@pytest.mark.parametrize("example", sorted(str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.toml")))
def test_every_example_loads_unchanged_its_owned_settings_read_by_their_components(example):
    """A stage's progress and executor settings are models of their own (pipeline/config.py), gathered from the
    stage's flat table: every example under deploy/ loads, each setting it writes reads back as written (the
    stage's dump is the flat table again), and each owned setting lands in its component's model."""
    import tomllib

    raw = tomllib.loads((DEPLOY / example).read_text())
    ws = load_workspace(DEPLOY / example)
    for name, table in (raw.get("stages") or {}).items():
        stage = ws.stage(name)
        dumped = stage.model_dump()
        assert {k: dumped[k] for k in table} == table, (example, name)
        assert stage.progress.kind == table.get("progress", "auto")
        assert stage.executor.kind == table.get("executor", "local") and stage.on_slurm == (
            isinstance(stage.executor, SlurmSettings))
        for key, value in table.items():
            if key in ("progress", "executor"):
                continue  # the kinds, above
            owner = stage.progress if key in type(stage.progress).model_fields else \
                stage.executor if key in type(stage.executor).model_fields else stage
            assert getattr(owner, key) == value, (example, key)
