"""The eagle3.toml configuration: pydantic models, lookup and one-line errors.

Every setting is declared once, with its default and a description; the docs test
and `eagle3 check-config` iterate these models.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from pipeline.errors import ConfigError

STAGE_NAMES = ("server", "regenerate", "extract", "train")
REQUIRED_STAGES = ("server", "extract", "train")  # regenerate is optional: shown once configured or run
PROGRESS_FIELDS = ("step", "total", "loss")  # what progress_fields may rename
PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*>")
DEFAULT_CONFIG_NAME = "eagle3.toml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- the progress source's settings: one model a source, chosen by the stage's `progress` ----------------------


_SOURCE = "the progress source (the stage's `progress`)"
_EXECUTOR = "the executor (the stage's `executor`)"


class _Progress(_Section):
    """Settings of one progress source. In eagle3.toml they sit flat in the stage's table beside `progress`
    (`progress_dir = …`); `StageConfig` gathers them here, and gives them back flat (`model_dump`)."""


class JsonlFields(_Progress):
    """Where a progress.jsonl is and what its fields are called (progress-jsonl's settings, and auto's: auto is
    progress-jsonl for train)."""

    progress_file: str | None = Field(
        default=None, description="With progress = progress-jsonl: the JSON-lines file (default: train out/progress.jsonl).")
    progress_fields: dict[str, str] = Field(
        default_factory=dict, description='With progress = progress-jsonl: this tool\'s names for step, total and loss, '
                                          'e.g. {step = "global_step", total = "max_steps", loss = "train_loss"}.')

    @field_validator("progress_fields")
    @classmethod
    def _fields(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(PROGRESS_FIELDS))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}: map any of {', '.join(PROGRESS_FIELDS)} to the "
                             "tool's field names")
        return value


class ProgressJsonlSettings(JsonlFields):
    kind: Literal["progress-jsonl"] = Field(default="progress-jsonl", description=_SOURCE)


class AutoProgress(JsonlFields):
    """The stage's own source: the manifest for extract and regenerate, progress.jsonl for train (whose file and
    field names may be set), none for the server."""

    kind: Literal["auto"] = Field(default="auto", description=_SOURCE)


class ManifestProgress(_Progress):
    kind: Literal["manifest"] = Field(default="manifest", description=_SOURCE)


class TensorboardSettings(_Progress):
    kind: Literal["tensorboard"] = Field(default="tensorboard", description=_SOURCE)
    progress_dir: str | None = Field(
        default=None, description="With progress = tensorboard: the event-file directory (SpecForge: <output_dir>/runs).")
    progress_tag: str | None = Field(
        default=None, description="With progress = tensorboard: the scalar whose step counts, e.g. \"train/loss\".")
    progress_total: int | None = Field(
        default=None, ge=1, description="With progress = tensorboard: the total steps (or progress_total_tag).")
    progress_total_tag: str | None = Field(
        default=None, description="With progress = tensorboard: a scalar holding the total steps, if the tool logs one.")
    loss_tag: str | None = Field(
        default=None, description="With progress = tensorboard: the loss scalar, shown in status, charts and metrics.")

    @model_validator(mode="after")
    def _needed(self):
        if not (self.progress_dir and self.progress_tag):
            raise ValueError('progress = "tensorboard" needs progress_dir (the event files) and progress_tag '
                             '(the scalar whose step counts, e.g. "train/loss")')
        return self


class LogRegexSettings(_Progress):
    kind: Literal["log-regex"] = Field(default="log-regex", description=_SOURCE)
    progress_regex: str | None = Field(
        default=None, description="With progress = log-regex: a regex with groups (?P<done>…) and optionally (?P<total>…).")

    @field_validator("progress_regex")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            compiled = _compile(value, "not a valid regular expression")
            if "done" not in compiled.groupindex:
                raise ValueError("the regex needs a named group (?P<done>\\d+)")
        return value


class FilesSettings(_Progress):
    kind: Literal["files"] = Field(default="files", description=_SOURCE)
    files_total: int | None = Field(default=None, ge=1, description="With progress = files: the expected file count.")


class NoProgress(_Progress):
    kind: Literal["none"] = Field(default="none", description=_SOURCE)


ProgressSettings = Annotated[AutoProgress | ManifestProgress | ProgressJsonlSettings | TensorboardSettings
                             | LogRegexSettings | FilesSettings | NoProgress, Field(discriminator="kind")]


# --- the executor's settings: one model an executor, chosen by the stage's `executor` ----------------------------


class LocalSettings(_Section):
    """A detached runner on this host: nothing to set."""

    kind: Literal["local"] = Field(default="local", description=_EXECUTOR)


class SlurmSettings(_Section):
    """A Slurm job (see [slurm] for the cluster's own settings)."""

    kind: Literal["slurm"] = Field(default="slurm", description=_EXECUTOR)
    nodes: int = Field(default=1, ge=1, description="Slurm: nodes for the job (above 1: `srun` + torchrun's c10d rendezvous).")
    gpus_per_node: int = Field(default=0, ge=0, description="Slurm: GPUs per node (`--gres=gpu:N`).")
    cpus_per_task: int = Field(default=1, ge=1, description="Slurm: CPUs for the stage's one task per node.")
    mem: str | None = Field(default=None, description='Slurm: memory per node, e.g. "64G" (unset: the partition\'s default).')
    slurm_args: list[str] = Field(default_factory=list, description='Slurm: more sbatch options for this stage only, '
                                  'e.g. ["--nodelist=gpu-017"] to put the server and extraction on one node.')
    limit_signal_s: int = Field(default=300, ge=0, description="Slurm: seconds before the job's time limit at which "
                                "the stage is told to stop with SIGTERM (it saves a checkpoint), by Slurm's "
                                "`--signal=B:USR1@N` (Slurm may send it up to a minute early); 0: no warning.")
    requeue: bool = Field(default=True, description="Slurm: after its time limit, a preemption or a node failure the "
                          "job is requeued (`--requeue`) or submitted again, up to max_restarts, and resumes from "
                          "its checkpoint.")


ExecutorSettings = Annotated[LocalSettings | SlurmSettings, Field(discriminator="kind")]

def _settings_of(models: tuple[type[_Section], ...]) -> dict[str, list[str]]:
    """Each owned setting's name → the kinds that have it."""
    owners: dict[str, list[str]] = {}
    for model in models:
        for name in model.model_fields:
            if name != "kind":
                owners.setdefault(name, []).append(model.model_fields["kind"].default)
    return owners


def _kinds(*models: type[_Section]) -> tuple[set[str], dict[str, list[str]]]:
    """(the kinds the models are chosen by, each owned setting → the kinds that have it), worked out once."""
    return {m.model_fields["kind"].default for m in models}, _settings_of(models)


# the stage's key that chooses → (its default, the kinds it chooses among, each owned setting's kinds)
_OWNED: dict[str, tuple[str, set[str], dict[str, list[str]]]] = {
    "progress": ("auto", *_kinds(AutoProgress, ManifestProgress, ProgressJsonlSettings, TensorboardSettings,
                                 LogRegexSettings, FilesSettings, NoProgress)),
    "executor": ("local", *_kinds(LocalSettings, SlurmSettings)),
}


class StageConfig(_Section):
    """One pipeline stage: what to run and how to supervise it. Its progress source's settings and its
    executor's settings are their own models (`progress`, `executor`), chosen by the keys of those names; the
    TOML keeps them flat in the stage's table."""

    argv: list[str] = Field(default_factory=list, description="Command as a list of arguments; never a shell string.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for the stage.")
    cwd: str | None = Field(default=None, description="Working directory (default: the config's directory).")
    gpus: list[int] = Field(default_factory=list, description="GPU indices, exported as CUDA_VISIBLE_DEVICES.")
    log: str | None = Field(default=None, description="Log file (default: <state dir>/logs/<stage>.log).")
    restart: Literal["never", "on-failure"] = Field(default="never", description="Restart policy when the stage dies.")
    max_restarts: int = Field(default=3, ge=0, description="Restarts allowed under on-failure.")
    restart_backoff_s: float = Field(default=10.0, ge=0, description="First restart delay; doubles each time.")
    final_exit_codes: list[int] = Field(
        default_factory=lambda: [2], description="Exit codes no restart can fix (a usage, configuration or input "
                                                 "error: eagle3's own commands and argparse exit 2): never restarted.")
    progress: ProgressSettings = Field(
        default_factory=AutoProgress, description="Progress authority: auto (manifest for extract and regenerate, "
        "progress.jsonl for train, none for server), manifest, progress-jsonl, tensorboard, log-regex, files or "
        "none; its settings beside it (progress_*, loss_tag, files_total).")
    done_when: str = Field(
        default="exit0", description='What "done" means: "exit0", "exit0-and-total" (and the last step reached the '
                                     'total), or "file:GLOB" (and a file matching GLOB exists, relative to cwd).')
    files_dir: str | None = Field(default=None, description="Output tree scanned for activity (default: extract out/hidden_states, train out).")
    files_suffix: str = Field(default="", description="Only files with this suffix count as final files.")
    executor: ExecutorSettings = Field(
        default_factory=LocalSettings, description="Who runs the stage: local (a detached runner on this host) or "
        "slurm (a Slurm job, see [slurm]; its settings beside it: nodes, gpus_per_node, cpus_per_task, mem, "
        "slurm_args).")

    @model_validator(mode="before")
    @classmethod
    def _gather(cls, data: Any) -> Any:
        """The flat TOML table → each owned model's own settings, under the key that chooses it. A setting of
        another kind than the one chosen is refused, naming both (it would be silently ignored otherwise)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key, (default, kinds, owners) in _OWNED.items():
            chosen = data.get(key, default)
            if isinstance(chosen, (dict, BaseModel)):
                continue  # already gathered (a model_copy, a model_validate of a dump)
            mine = {name: data.pop(name) for name in list(data) if name in owners}
            if isinstance(chosen, str) and chosen in kinds:
                for name in mine:
                    if chosen not in owners[name]:
                        theirs = [f'"{k}"' for k in owners[name] if k != "auto"]
                        raise ValueError(f'{name} is a setting of {key} = {" or ".join(theirs)}, and this stage\'s '
                                         f'{key} is "{chosen}": set {key} = {theirs[0]}, or remove {name}')
            data[key] = {"kind": chosen, **mine}
        return data

    @model_serializer(mode="wrap")
    def _flat(self, handler) -> dict[str, Any]:
        """The stage as eagle3.toml writes it: the owned settings flat beside the key that chose them."""
        out = handler(self)
        for key in _OWNED:
            owned = dict(out.pop(key))
            out[key] = owned.pop("kind")
            out.update(owned)
        return out

    @field_validator("done_when")
    @classmethod
    def _done_when(cls, value: str) -> str:
        if value in ("exit0", "exit0-and-total") or (value.startswith("file:") and value[5:].strip()):
            return value
        raise ValueError(f'expected "exit0", "exit0-and-total" or "file:GLOB", got {value!r}')

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_list(cls, value: object) -> object:
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
            raise ValueError(f"expected a list of GPU indices such as [0, 1, 2, 3], got {_show(value)}")
        return value

    @field_validator("argv", mode="before")
    @classmethod
    def _argv_list(cls, value: object) -> object:
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise ValueError(f'expected a list of strings such as ["python", "-m", "x"], got {_show(value)}')
        return value

    @property
    def on_slurm(self) -> bool:
        return self.executor.kind == "slurm"


class ServerStage(StageConfig):
    """The SGLang server holding the target model."""

    url: str = Field(default="http://127.0.0.1:30000", description="Base URL for /health, /server_info, /metrics.")
    port: int = Field(default=30000, ge=1, le=65535, description="Port the server listens on (checked free after a stop).")


class RegenerateStage(StageConfig):
    """Optional, before extraction: the target answers the dataset's assistant turns again (eagle3 regenerate)."""

    data: str | None = Field(default=None, description="eagle3 prepare's JSONL (id, input_ids, loss_mask).")
    out: str | None = Field(default=None, description="The regenerated JSONL (the extraction's data); OUT.parts/ holds "
                                                      "its manifest.sqlite, the progress authority.")


class ExtractStage(StageConfig):
    """The hidden-state extraction client."""

    data: str | None = Field(default=None, description="Dataset JSONL, one sample a line with input_ids.")
    out: str | None = Field(default=None, description="Output directory; its manifest.sqlite is the progress authority.")


class TrainStage(StageConfig):
    """The torchrun draft-head trainer."""

    out: str | None = Field(default=None, description="Checkpoint directory; holds progress.jsonl.")


class Stages(_Section):
    """The pipeline stages (regenerate is optional)."""

    server: ServerStage = Field(default_factory=ServerStage, description="SGLang server stage.")
    regenerate: RegenerateStage = Field(default_factory=RegenerateStage,
                                        description="Optional regeneration stage (before extract; the server stays up).")
    extract: ExtractStage = Field(default_factory=ExtractStage, description="Extraction stage.")
    train: TrainStage = Field(default_factory=TrainStage, description="Training stage.")


def _compile(pattern: str, what: str) -> re.Pattern:
    """A compiled regex, or the ValueError pydantic turns into the config's one-line error."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{what} ({exc})") from None


SECRET_ENV = ("SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "SLACK_SIGNING_SECRET")
RUN_ENV = "EAGLE3_RUN"  # in each stage's environment: the run it belongs to (the trainer records it per checkpoint)


def without_secrets(env) -> dict[str, str]:
    """An environment for child processes: the Slack secrets are the service's alone."""
    return {k: v for k, v in env.items() if k not in SECRET_ENV}


class SlackConfig(_Section):
    """Where the bot posts and who may act through it."""

    channel: str | None = Field(default=None, description="Channel id for progress posts and alerts.")
    allowed_user_ids: list[str] = Field(default_factory=list, description="Users allowed to take mutating actions.")
    allowed_channel_ids: list[str] = Field(default_factory=list, description="Channels the bot answers in (empty: any).")
    oncall_user_ids: list[str] = Field(default_factory=list, description="Users @-mentioned on alerts.")
    post_interval_min: float = Field(default=30, gt=0, description="Minutes between scheduled progress updates.")
    min_edit_s: float = Field(default=10.0, gt=0, description="The status post is edited when a verdict, a stage's "
                              "state or the handoff step changes, at most once per this many seconds.")
    escalate_after_min: float = Field(default=30, gt=0, description="Minutes a stall alert may stay open and "
                                      "unacknowledged before it is escalated (a broadcast reply in its thread that "
                                      "mentions on-call again).")
    redact_patterns: list[str] = Field(
        default_factory=list, description="Regexes masked in log excerpts posted to Slack, besides tokens and Authorization headers.")

    @field_validator("redact_patterns")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for i, pattern in enumerate(value):
            _compile(pattern, f"entry {i} ({pattern!r}) is not a valid regular expression")
        return value


class MonitorConfig(_Section):
    """The sampler and stall detector."""

    tick_s: float = Field(default=10.0, gt=0, description="Seconds between observations.")
    stall_floor_s: float = Field(default=60.0, gt=0, description="Shortest no-progress time that can count as a stall "
                                 "(the deadline is the larger of this and 3× the stage's own longest usual gap).")
    probe_budget_s: float = Field(default=5.0, gt=0, description="Time a tick's probes may take; slower readings are unknown.")
    fake_gpus: int = Field(default=0, ge=0, description="Use this many scripted fake GPUs instead of NVML (tests, demo).")
    remote_every_s: float = Field(default=10.0, gt=0, description="Slurm jobs on other nodes: seconds between readings "
                                  "of their processes and GPUs on those nodes (`srun --overlap` launches a step "
                                  "each time); in between, the last reading is shown with its age.")


class HandoffConfig(_Section):
    """The extraction-to-training handoff."""

    max_failed_share: float = Field(default=0.001, ge=0, le=1, description="Largest failed share that still counts as complete.")
    server_stop_grace_s: float = Field(default=60.0, ge=0, description="Seconds between SIGTERM and SIGKILL when stopping the server.")
    gpu_release_timeout_s: float = Field(default=300.0, gt=0, description="Longest wait for the training GPUs' memory to return to its baseline.")
    gpu_release_tolerance_mb: float = Field(default=1024.0, ge=0, description="Memory above the baseline that still counts as released.")
    settle_s: float = Field(default=5.0, ge=0, description="Without NVML: wait this long after the server's processes are gone.")
    verify_sample: int = Field(default=200, ge=1, description="Files `verify` opens before training may start.")
    launch_attempts: int = Field(default=3, ge=1, description="Tries to start training before the handoff fails with the cause.")
    launch_backoff_s: float = Field(default=10.0, ge=0, description="Wait after the first failed launch; doubles each time.")
    autostart: bool = Field(default=False, description="Arm auto-start for every new run (default: each run starts off).")


class MetricsConfig(_Section):
    """Prometheus' /metrics, served by `eagle3 serve`."""

    port: int | None = Field(default=None, ge=0, le=65535, description="Port for /metrics (unset: not served; 0: any).")
    host: str = Field(default="127.0.0.1", description="Address /metrics listens on.")
    docs_url: str | None = Field(default=None, description="Base URL of this project's docs/ for the alert rules' "
                                 "runbook links (eagle3_build_info's docs_url; unset: the checkout's repository web "
                                 "view at its revision, else the install's docs/ as a file URL).")


class SlurmConfig(_Section):
    """Defaults for stages with executor = "slurm" (the job's shape is per stage)."""

    partition: str | None = Field(default=None, description="Partition (unset: the cluster's default).")
    account: str | None = Field(default=None, description="Account charged for the jobs.")
    qos: str | None = Field(default=None, description="Quality of service.")
    time: str | None = Field(default=None, description='Time limit, e.g. "12:00:00" (unset: the partition\'s).')
    extra_args: list[str] = Field(default_factory=list, description='More sbatch options, e.g. ["--exclusive"].')


class StateConfig(_Section):
    """Where eagle3 keeps its own state."""

    dir: str = Field(default=".eagle3", description="State directory (store, stage logs).")
    log_max_bytes: int = Field(default=100_000_000, gt=0, description="Rotate a stage log past this size.")
    log_keep: int = Field(default=3, ge=1, description="Rotated log files kept per stage.")


class Config(_Section):
    """A whole eagle3.toml."""

    stages: Stages = Field(default_factory=Stages, description="The pipeline stages.")
    slack: SlackConfig = Field(default_factory=SlackConfig, description="Slack settings (secrets come from the environment).")
    monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="Monitoring settings.")
    handoff: HandoffConfig = Field(default_factory=HandoffConfig, description="Handoff settings.")
    state: StateConfig = Field(default_factory=StateConfig, description="State settings.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus metrics.")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="Slurm settings for stages run as jobs.")


RUN_TOKEN = "{run}"  # in a stage's paths and argv: the run's id, so each run writes a place of its own


def _expand(value: object, run: str) -> object:
    if isinstance(value, BaseModel):  # a stage's progress or executor settings
        return value.model_copy(update={k: _expand(getattr(value, k), run) for k in type(value).model_fields})
    if isinstance(value, str):
        return value.replace(RUN_TOKEN, run)
    if isinstance(value, list):
        return [_expand(v, run) for v in value]
    if isinstance(value, dict):
        return {k: _expand(v, run) for k, v in value.items()}
    return value


class Workspace:
    """A loaded config plus the directory its relative paths are resolved against. A stage's strings may hold
    `{run}`; `for_run(run)` gives the workspace as that run sees it, `{run}` replaced by the run's id."""

    def __init__(self, *, config: Config, path: Path, run: str | None = None) -> None:
        self.config = config
        self.path = path.resolve()
        self.root = self.path.parent
        self.run = run  # the run `{run}` was expanded for (None: not expanded)
        self._bound: dict[str, Workspace] = {}
        # whether some stage's setting names `{run}` (and so means another place in each run): the config is
        # not changed after loading, so this is read once
        self.run_scoped = run is None and any(RUN_TOKEN in text for name in STAGE_NAMES
                                              for value in self.stage(name).model_dump().values()
                                              for text in _strings(value))

    def for_run(self, run: str | None) -> Workspace:
        """This workspace as run `run` sees it: `{run}` in the stages' settings replaced by its id. Itself where
        no setting names `{run}` or no run is given (a `{run}` then stays as written: nothing reads such a path)."""
        if run is None or not self.run_scoped:
            return self
        if run not in self._bound:
            stages = self.config.stages
            bound = stages.model_copy(update={
                name: getattr(stages, name).model_copy(update={
                    k: _expand(getattr(getattr(stages, name), k), run)
                    for k in type(getattr(stages, name)).model_fields}) for name in STAGE_NAMES})
            self._bound[run] = Workspace(config=self.config.model_copy(update={"stages": bound}), path=self.path,
                                         run=run)
        return self._bound[run]

    @overload
    def resolve(self, value: str) -> Path: ...

    @overload
    def resolve(self, value: None) -> None: ...

    @overload
    def resolve(self, value: str | None) -> Path | None: ...

    def resolve(self, value: str | None) -> Path | None:
        """Resolve a configured path against the config's directory (None stays None)."""
        if value is None:
            return None
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else self.root / p

    @property
    def state_dir(self) -> Path:
        """Directory holding the store and stage logs."""
        return self.resolve(self.config.state.dir)

    @property
    def store_path(self) -> Path:
        """The sqlite state store."""
        return self.state_dir / "state.sqlite"

    def stage(self, name: str) -> StageConfig:
        """The configuration of stage `name`."""
        return getattr(self.config.stages, name)

    def out_dir(self, name: str) -> Path | None:
        """Stage `name`'s output (its `out`, resolved; None where it has none: the server, or not configured)."""
        return self.resolve(getattr(self.stage(name), "out", None))

    def forensics_dir(self, run: str | None) -> Path:
        """Where a run's "why is it stuck?" evidence is kept."""
        return self.state_dir / "forensics" / (run or "no-run")

    def flight_dir(self, run: str | None) -> Path:
        """Where a run's training dumps PyTorch's flight recorder (pipeline/train/flight.py)."""
        return self.forensics_dir(run) / "flight-recorder"

    def log_path(self, name: str) -> Path:
        """Where stage `name` writes its output."""
        configured = self.stage(name).log
        return self.resolve(configured) if configured else self.state_dir / "logs" / f"{name}.log"

    def require_filled(self, name: str) -> None:
        """Refuse, naming the key, when stage `name` still holds a template placeholder."""
        stage = self.stage(name)
        if not stage.argv:
            raise ConfigError(f"{self.path.name}: stages.{name}.argv is empty; set the command to run for {name}")
        for key, value in stage.model_dump().items():
            for text in _strings(value):
                found = PLACEHOLDER.search(text)
                if found:
                    raise ConfigError(
                        f"{self.path.name}: stages.{name}.{key} still holds the placeholder {found.group(0)}; "
                        f"replace it before starting {name}"
                    )


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, str)]
    return []


def _show(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _where(loc: tuple) -> str:
    """The key as eagle3.toml spells it: a stage's owned settings sit flat in its table, so the model's path
    (`stages.train.progress.tensorboard.progress_dir`) reads `stages.train.progress_dir`, and an error of the
    settings as a whole (`….progress.tensorboard`) reads `stages.train.progress`."""
    parts = [str(p) for p in loc]
    for i in range(len(parts) - 1):
        if parts[i] in _OWNED and i >= 2 and parts[i - 2] == "stages":
            rest = parts[i + 2:]
            parts = parts[:i] + rest if rest else parts[:i + 1]
            break
    return ".".join(parts) or "(top level)"


def _format_error(name: str, err: ValidationError) -> str:
    first = err.errors()[0]
    where = _where(first["loc"])
    kind = first["type"]
    if kind == "union_tag_invalid":
        ctx = first.get("ctx") or {}
        return (f"{name}: {where}: expected one of {ctx.get('expected_tags', '')}, "
                f"got {_show(ctx.get('tag'))}")
    if kind == "extra_forbidden":
        return f"{name}: {where}: unknown setting; check its spelling against `eagle3 init` or deploy/eagle3.example.toml"
    msg = first["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return f"{name}: {where}: {msg}"
    return f"{name}: {where}: {msg[0].lower()}{msg[1:]}, got {_show(first.get('input'))}"


def parse_config(text: str, *, name: str) -> Config:
    """Parse and validate TOML text; raise ConfigError with one line on failure."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: not valid TOML: {exc}; fix the syntax at that line") from None
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_error(name, exc)) from None


def load_workspace(path: Path) -> Workspace:
    """Read and validate the config at `path`."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file; create one with `eagle3 init` or pass --config FILE") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config ({exc}); check the path and its permissions") from None
    return Workspace(config=parse_config(text, name=path.name), path=path)


class LiveWorkspace:
    """The config file as `serve` keeps reading it. The monitor calls `current()` each tick: the file is loaded
    again when it changed (its mtime or size) and it loads, else the last one that did stays, with `error` saying
    why; `changes` counts the times the file was seen to change. The Slack commands read `ws`, what the last tick
    loaded, so a request touches no file."""

    def __init__(self, ws: Workspace) -> None:
        self.ws, self.changes = ws, 0
        self.error: str | None = None
        self.seen = _stat(ws.path)

    def current(self) -> Workspace:
        seen = _stat(self.ws.path)
        if seen != self.seen:
            self.seen, self.changes = seen, self.changes + 1
            try:
                self.ws, self.error = load_workspace(self.ws.path), None
            except ConfigError as exc:
                self.error = str(exc)
        return self.ws


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def find_config(explicit: str | None) -> Path:
    """Config lookup order: --config, then $EAGLE3_CONFIG, then ./eagle3.toml."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("EAGLE3_CONFIG")
    if env:
        return Path(env)
    local = Path.cwd() / DEFAULT_CONFIG_NAME
    if local.exists():
        return local
    raise ConfigError(
        f"no config found: pass --config FILE, set EAGLE3_CONFIG, or run `eagle3 init` to write ./{DEFAULT_CONFIG_NAME}"
    )
