"""Config parsing, lookup, placeholders and one-line errors."""

import pytest

from pipeline.config import Config, find_config, load_workspace, parse_config
from pipeline.errors import ConfigError
from pipeline.templates import PRODUCTION_TEMPLATE


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[stages.train]\ngpus = "0-3"',
         'eagle3.toml: stages.train.gpus: expected a list of GPU indices such as [0, 1, 2, 3], got "0-3"'),
        ("[stages.train]\ngpu = [1]", "eagle3.toml: stages.train.gpu: unknown setting"),
        ('[monitor]\ntick_s = "soon"', 'eagle3.toml: monitor.tick_s: input should be a valid number'),
        ("[stages.server]\nport = 99999", "eagle3.toml: stages.server.port: input should be less than or equal to 65535, got 99999"),
        ('[stages.server]\nargv = "python -m sglang"', "eagle3.toml: stages.server.argv: expected a list of strings"),
        ("[handoff]\nmax_failed_share = 2", "eagle3.toml: handoff.max_failed_share:"),
        ("x = ", "eagle3.toml: not valid TOML"),
        # a stage's owned settings are named as the TOML writes them, flat in the stage's table
        ('[stages.train]\nprogress = "log-regex"\nprogress_regex = "("', "eagle3.toml: stages.train.progress_regex: "
         "not a valid regular expression"),
        ('[stages.train]\nprogress = "tensorboard"', 'eagle3.toml: stages.train.progress: progress = "tensorboard" '
         "needs progress_dir"),
        ('[stages.train]\nexecutor = "slurm"\nnodes = 0', "eagle3.toml: stages.train.nodes: input should be greater"),
        ('[stages.train]\nexecutor = "k8s"', "eagle3.toml: stages.train.executor: expected one of 'local', 'slurm', "
         'got "k8s"'),
        # a setting of another kind than the stage's would be ignored: refused, naming both
        ('[stages.train]\nprogress_regex = "(?P<done>1)"', 'eagle3.toml: stages.train: progress_regex is a setting of '
         'progress = "log-regex", and this stage\'s progress is "auto": set progress = "log-regex", or remove'),
        ("[stages.train]\nnodes = 2", 'eagle3.toml: stages.train: nodes is a setting of executor = "slurm", and this '
         'stage\'s executor is "local"'),
    ],
)
def test_bad_config_is_one_line_naming_key(text, expected):
    with pytest.raises(ConfigError) as err:
        parse_config(text, name="eagle3.toml")
    message = str(err.value)
    assert message.startswith(expected)
    assert "\n" not in message


def test_defaults_are_documented():
    import typing

    seen = []

    def walk(model):
        seen.append(model.__name__)
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            for ann in (field.annotation, *typing.get_args(field.annotation)):  # a union: each of its models
                if isinstance(ann, type) and issubclass(ann, Config.__mro__[1]):
                    walk(ann)
    walk(Config)
    assert {"TensorboardSettings", "SlurmSettings", "AutoProgress"} <= set(seen)  # the owned settings, walked too


def test_production_template_is_valid_and_has_placeholders(tmp_path):
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(PRODUCTION_TEMPLATE)
    ws = load_workspace(cfg)
    assert ws.stage("server").gpus == list(range(8))
    assert ws.stage("train").gpus == [0, 1, 2, 3]
    assert "--enable-return-hidden-states" in ws.stage("server").argv
    assert "--disable-radix-cache" in ws.stage("server").argv
    with pytest.raises(ConfigError, match=r"stages\.server\.argv still holds the placeholder <SGLANG_VENV>"):
        ws.require_filled("server")
    with pytest.raises(ConfigError, match=r"stages\.extract\.argv still holds the placeholder <DATA_JSONL>"):
        ws.require_filled("extract")


def test_relative_paths_resolve_against_config_dir(tmp_path):
    sub = tmp_path / "ws"
    sub.mkdir()
    cfg = sub / "eagle3.toml"
    cfg.write_text('[stages.extract]\nout = "out"\n[state]\ndir = "st"\n')
    ws = load_workspace(cfg)
    assert ws.resolve(ws.stage("extract").out) == sub / "out"
    assert ws.store_path == sub / "st" / "state.sqlite"
    assert ws.log_path("train") == sub / "st" / "logs" / "train.log"


def test_lookup_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EAGLE3_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="no config found"):
        find_config(None)
    (tmp_path / "eagle3.toml").write_text("")
    assert find_config(None) == tmp_path / "eagle3.toml"
    monkeypatch.setenv("EAGLE3_CONFIG", "/elsewhere.toml")
    assert str(find_config(None)) == "/elsewhere.toml"
    assert str(find_config("explicit.toml")) == "explicit.toml"


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_workspace(tmp_path / "nope.toml")
