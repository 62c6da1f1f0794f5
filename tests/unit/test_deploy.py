"""The deploy kit validates."""

from pathlib import Path

from pipeline.config import PLACEHOLDER, load_workspace

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


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
    assert ws.stage("train").argv[:4] == ["torchrun", "--standalone", "--nproc-per-node", "4"]
