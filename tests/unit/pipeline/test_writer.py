"""The extraction's numpy writer writes what safetensors.torch wrote, byte for byte, without torch."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.extract.verify import verify
from pipeline.extract.writer import Tensor, read_sample, tensors_for, to_bf16_bits, write_sample
from tests.conftest import ROOT


def _edge_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    bits = bits[((bits >> 23) & 0xFF) != 0xFF]  # finite patterns, subnormals included
    ties = (rng.integers(0, 2**16, size=1000, dtype=np.uint32) << 16) | 0x8000  # exactly half way: to even
    special = np.array([0.0, -0.0, 1.0, -1.0, 3.3895314e38, -3.3895314e38, 1e-45, 65504.0, 65520.0, 1e-8],
                       dtype=np.float32).view(np.uint32)
    return np.concatenate([bits, ties, special]).view(np.float32)


def _split(path) -> tuple[dict, bytes]:
    import json

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_bf16_rounding_is_torchs_bit_for_bit():
    x = _edge_floats()
    ours = to_bf16_bits(x)
    theirs = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    nan = np.array([np.nan, -np.nan], dtype=np.float32)
    assert np.array_equal(to_bf16_bits(nan), torch.from_numpy(nan).to(torch.bfloat16).view(torch.int16).numpy()
                          .view(np.uint16))


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                               ("fp32", torch.float32)])
def test_files_are_byte_for_byte_the_torch_writers(tmp_path, dtype, torch_dtype):
    seq, layers, width = 37, 4, 64
    rows = _edge_floats()[: seq * layers * width].reshape(seq, layers * width)
    ids = list(range(seq))
    mask = [i % 2 for i in range(seq)]
    topk = ([[i, i + 1] for i in range(seq)], [[-0.5, -1.5]] * seq)
    meta = {"model": "toy", "layer_ids": "[1, 2, 3]", "id": "s7"}
    write_sample(tmp_path / "ours.safetensors", tensors_for(token_ids=ids, rows=rows, layers=layers, dtype=dtype,
                                                            topk=topk, loss_mask=mask), meta)
    reference = {"token_ids": torch.tensor(ids, dtype=torch.int64),
                 "hidden_states": torch.from_numpy(rows.copy()).reshape(seq, layers, width).to(torch_dtype).contiguous(),
                 "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                 "target_topk_ids": torch.tensor(topk[0], dtype=torch.int64),
                 "target_topk_logprobs": torch.tensor(topk[1], dtype=torch.float32)}
    save_file(reference, str(tmp_path / "torch.safetensors"), metadata=meta)
    # safetensors keeps the metadata in a hash map: even two torch writes order it differently. The
    # header as JSON and every byte after it are the same.
    ours, theirs = (_split(tmp_path / f"{n}.safetensors") for n in ("ours", "torch"))
    assert ours[0] == theirs[0] and ours[1] == theirs[1]
    back = load_file(tmp_path / "ours.safetensors")
    assert back["hidden_states"].dtype == torch_dtype and back["hidden_states"].shape == (seq, layers, width)
    # and read back without torch (verify's reader): every tensor's bytes, dtype and shape as torch reads them
    read = read_sample(tmp_path / "torch.safetensors")
    assert read.keys() == reference.keys()
    for name, t in reference.items():
        ours_t = read[name]
        assert ours_t.dtype == str(t.dtype).removeprefix("torch.") and ours_t.shape == tuple(t.shape)
        assert ours_t.array.tobytes() == t.numpy().tobytes() if t.dtype != torch.bfloat16 else \
            ours_t.array.tobytes() == t.view(torch.int16).numpy().tobytes()


def test_the_extraction_client_starts_without_torch():
    code = "import sys, pipeline.extract.client, bot.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_a_sample_file_gets_the_mode_the_umask_allows(tmp_path, mask, mode):
    """safetensors creates its files 0600 whatever the umask: a trainer running as another user could
    not read the hidden states (issue 30)."""
    old = os.umask(mask)
    try:
        path = tmp_path / "hs_0.safetensors"
        write_sample(path, tensors_for(token_ids=[1, 2], rows=np.zeros((2, 8), np.float32), layers=2, dtype="bf16",
                                       topk=None), {})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode


@pytest.fixture
def extraction_copy(tmp_path, toy_extraction):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(toy_extraction["out"], out)
    return out


def test_verify_reads_without_torch_and_finds_each_fault(extraction_copy):
    """verify runs in the bot's service at the handoff: it reads the files with numpy (torch would cost the
    service ~2 CPU-s and ~300 MB for good), and still finds a truncated file, a NaN, a wrong shape."""
    out = extraction_copy
    code = ("import sys; from pipeline.extract.verify import verify; r = verify(sys.argv[1], sample=500); "
            "print(r.checked, r.ok, 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["160", "True", "False"], res.stdout + res.stderr

    files = sorted((out / "hidden_states").iterdir(), key=lambda f: int(f.stem.split("_")[1]))
    files[3].write_bytes(files[3].read_bytes()[:-10])  # truncated
    t = read_sample(files[5])
    hs = t["hidden_states"].array.copy()
    hs[0, 0, 0] = 0x7FC0  # a bfloat16 NaN
    write_sample(files[5], {**t, "hidden_states": Tensor("bfloat16", hs)}, {})
    t7 = read_sample(files[7])
    write_sample(files[7], {**t7, "hidden_states": Tensor("bfloat16", t7["hidden_states"].array[:, :2])}, {})
    files[9].write_bytes(b"\x00" * 7)  # no header
    t11 = read_sample(files[11])
    write_sample(files[11], {**t11, "token_ids": Tensor("int64", t11["token_ids"].array[None])}, {})  # [1, seq]
    problems = verify(out, sample=500).problems
    assert len(problems) == 6, problems
    assert problems[0].startswith(f"{files[3].name}: unreadable (ValueError: hidden_states: its data")
    assert problems[1] == f"{files[5].name}: non-finite values"
    assert problems[2].startswith(f"{files[7].name}: hidden_states ({t7['token_ids'].shape[0]}, 2, "), problems
    assert problems[3] == f"{files[9].name}: unreadable (ValueError: no safetensors header (7 bytes))"
    assert problems[4].startswith(f"{files[11].name}: hidden_states (") and "expected (?, " in problems[4]
    assert problems[5] == f"{files[11].name}: token_ids differ from data line 12"


def test_a_checkpoint_is_on_the_disk_before_latest_names_it_and_a_sample_before_the_manifest(tmp_path, monkeypatch):
    """A node that loses power right after `latest` moves must not resume from files still in the page cache:
    every file a rank wrote, and the step's directory, are fsync-ed before the rename; the rename itself
    after. Likewise a sample file and its directory entry before write_sample returns (the manifest then
    calls the sample done)."""
    import pipeline.durable
    from pipeline.train import checkpoint

    events = []
    real_fsync, real_replace = pipeline.durable.fsync_path, os.replace
    monkeypatch.setattr(checkpoint, "fsync_path", lambda p: (events.append(("fsync", os.path.basename(p))),
                                                              real_fsync(p)))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (events.append(("replace", os.path.basename(b))),
                                                                real_replace(a, b)))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    config = type("Config", (), {"to_dict": lambda self: {"hidden_size": 4}})()
    checkpoint.save(tmp_path, step=7, model=model, opt=opt, sched=sched, rank=0, barrier=lambda: None, config=config)
    assert checkpoint.latest_step(tmp_path) == 7
    moved = events.index(("replace", "latest"))
    before = {name for kind, name in events[:moved] if kind == "fsync"}
    assert {"rng_rank0.pt", "model.safetensors", "optim.pt", checkpoint.CONFIG_NAME, "state.json", "step_7",
            "checkpoints", ".latest.tmp"} <= before, events
    assert events[moved + 1:] == [("fsync", tmp_path.name)], events

    import pipeline.extract.writer as writer

    synced = []
    monkeypatch.setattr(writer, "fsync_path", lambda p: (synced.append(os.path.basename(p)), real_fsync(p)))
    out = tmp_path / "hs" / "hs_0.safetensors"
    out.parent.mkdir()
    write_sample(out, tensors_for(token_ids=[1, 2, 3], rows=np.ones((3, 8)), layers=4, dtype="bf16", topk=None), {})
    assert synced == [".hs_0.safetensors.tmp", "hs"], synced
