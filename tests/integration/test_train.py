"""The trainer under real torchrun (2 CPU processes, gloo on loopback), and its bad-input paths."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.train.loop import main as train_main
from tests.conftest import ROOT, TRAIN_ENV, TRAIN_SMALL, TRAIN_STEPS, wait_for

pytestmark = pytest.mark.timeout(300)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "pipeline.train"]
ENV, SMALL = TRAIN_ENV, TRAIN_SMALL


def torchrun(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([*TORCHRUN, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, **kw)


def progress(ckpt: Path) -> list[dict]:
    path = ckpt / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_torchrun_learns_the_target_and_a_sigterm_then_resume_matches_the_uninterrupted_run(
        toy_extraction, uninterrupted_training, tmp_path):
    """Run a: 30 steps uninterrupted (it learns; the export loads; the shared fixture, which the Slurm time-limit
    test matches too); run b: the same run stopped by SIGTERM after 8 steps, then resumed (`--lm-head`, the older
    name of `--target-model`)."""
    data, target = str(toy_extraction["out"]), str(toy_extraction["target"])
    common = ["--data", data, "--lm-head", target, "--steps", str(TRAIN_STEPS), *SMALL]
    b = torchrun(*common, "--out", str(tmp_path / "b"))
    wait_for(lambda: len(progress(tmp_path / "b")) >= 8, timeout=200, what="8 steps of run b")
    os.killpg(b.pid, signal.SIGTERM)
    out_b = b.communicate(timeout=120)[0]
    assert "checkpoint saved at step" in out_b, out_b
    saved = int((tmp_path / "b" / "latest").read_text().strip().removeprefix("step_"))
    assert saved < 25
    out = uninterrupted_training["output"]
    resumed = torchrun(*common, "--out", str(tmp_path / "b"))  # resuming is the default (issue 30)
    assert resumed.communicate(timeout=280)[0] is not None and resumed.returncode == 0

    # run a learned, and its export is what SGLang loads
    ckpt = uninterrupted_training["ckpt"]
    assert "target from the final hidden state (post-norm) through the target's LM head" in out
    assert "Warning" not in out, out  # the operator's log holds the trainer's lines, not torch's deprecations
    la = progress(ckpt)
    assert [r["step"] for r in la] == list(range(1, 31))
    assert all(set(r) - {"disk_need_bytes"} == {"step", "total_steps", "loss", "kl", "tokens_per_s", "lr"}
               and r["lr"] >= 0 for r in la)
    assert max(r["lr"] for r in la) > la[-1]["lr"]  # the schedule as logged: up, then down (cosine ends at 0)
    assert la[-1]["kl"] <= 0.5 * la[0]["kl"], (la[0], la[-1])
    val = json.loads((ckpt / "validation.jsonl").read_text().splitlines()[-1])
    assert val["acc"][0] > val["baseline_top1"]
    step = ckpt / "checkpoints" / "step_30"
    assert {p.name for p in step.iterdir()} >= {"model.safetensors", "optim.pt", "rng_rank0.pt", "rng_rank1.pt"}
    assert "fc.weight" in load_file(step / "model.safetensors")
    assert (ckpt / "latest").read_text().strip() == "step_30"
    from pipeline.draft.sglang import check_export
    assert check_export(ckpt / "draft") == []
    for f in (ckpt / "draft" / "model.safetensors", step / "model.safetensors"):
        assert f.stat().st_mode & 0o777 == 0o644, f  # an SGLang server running as another user loads it
    assert f"--speculative-draft-model-path {ckpt / 'draft'}" in out

    # run b resumed where it stopped and then matched run a step for step
    loss_a = {r["step"]: r["loss"] for r in la}
    lb = progress(tmp_path / "b")
    assert [r["step"] for r in lb] == list(range(1, 31)), "steps must not repeat or skip across the resume"
    for r in lb[saved: saved + 5]:
        assert r["loss"] == pytest.approx(loss_a[r["step"]], rel=1e-5), (r["step"], r["loss"], loss_a[r["step"]])


def copy_data(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_wrong_shape_stops_before_step_1_naming_file_and_tensor(toy_extraction, tmp_path, capsys):
    data = copy_data(toy_extraction["out"], tmp_path / "data")
    f = data / "hidden_states" / "hs_5.safetensors"
    t = load_file(f)
    save_file({"token_ids": t["token_ids"], "hidden_states": t["hidden_states"][:, :, :32].contiguous()}, f)
    rc = train_main(["--data", str(data), "--target-model", str(toy_extraction["target"]), "--out", str(tmp_path / "c"),
                     "--steps", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "hs_5.safetensors: tensor hidden_states has shape" in err and "expected [" in err
    assert not (tmp_path / "c" / "progress.jsonl").exists()


def test_missing_file_is_an_error_unless_skip_bad(toy_extraction, tmp_path, capsys):
    data = copy_data(toy_extraction["out"], tmp_path / "data")
    (data / "hidden_states" / "hs_9.safetensors").unlink()
    args = ["--data", str(data), "--target-model", str(toy_extraction["target"]), "--out", str(tmp_path / "c"), "--steps", "2"]
    assert train_main(args) == 2
    assert "hs_9.safetensors: unreadable" in capsys.readouterr().err
    assert train_main([*args, "--skip-bad"]) == 0
    assert "1 bad file(s) skipped" in capsys.readouterr().out


def test_nan_stops_with_a_clear_error_reported_in_progress(toy_extraction, tmp_path, capsys):
    data = copy_data(toy_extraction["out"], tmp_path / "data")
    for f in (data / "hidden_states").iterdir():
        t = load_file(f)
        t["hidden_states"] = torch.full_like(t["hidden_states"], float("nan"))
        save_file(t, f)
    rc = train_main(["--data", str(data), "--target-model", str(toy_extraction["target"]), "--out", str(tmp_path / "c"),
                     "--steps", "3"])
    assert rc == 3
    assert "training stopped: loss is nan at step 1" in capsys.readouterr().err
    last = progress(tmp_path / "c")[-1]
    assert last["loss"] is None and "nan" in last["error"]


def test_training_needs_the_target_model(toy_extraction, tmp_path, capsys):
    assert train_main(["--data", str(toy_extraction["out"]), "--out", str(tmp_path / "c"), "--steps", "1"]) == 2
    assert "pass --target-model DIR" in capsys.readouterr().err


def test_topk_targets_from_stock_server(tmp_path, capsys):
    from tests.conftest import eagle3
    from tests.toy import ToyServer, write_dataset

    """Issue 51: with the final layer absent (stock SGLang), the default K = 256 captures the (toy's 256-token)
    distribution whole; a small K is warned about where it is recorded (per sample in the manifest), said at the
    extraction's end and by the trainer, which also says how much its draft vocabulary keeps."""
    from pipeline.manifest import summarize

    server = ToyServer("--stock")
    try:
        write_dataset(tmp_path / "d.jsonl", 24, lo=16, hi=64)
        whole = eagle3("extract", "--server", server.url, "--data", str(tmp_path / "d.jsonl"), "--out",
                       str(tmp_path / "out"), "--concurrency", "8")
        small = eagle3("extract", "--server", server.url, "--data", str(tmp_path / "d.jsonl"), "--out",
                       str(tmp_path / "out8"), "--target-topk", "8", "--concurrency", "8")
    finally:
        server.stop()
    assert whole.returncode == 0 and small.returncode == 0, whole.stderr + small.stderr
    s, s8 = summarize(tmp_path / "out"), summarize(tmp_path / "out8")
    assert s["topk_mass"] == pytest.approx(1.0, abs=1e-3) and s["topk_mass_samples"] == 24 and s["topk_mass_low"] == 0
    assert s8["topk_mass"] < 0.95 and s8["topk_mass_low"] == 24, s8
    said = whole.stdout + whole.stderr
    assert "the stored top-K logprobs hold 100.0 % of the target's probability (mean of 24 samples)" in said, said
    assert "WARNING: below 95 % on average" in small.stdout + small.stderr
    _toy_target(tmp_path)  # what `eagle3 toy-server --export-target` writes, in-process
    rc = train_main(["--data", str(tmp_path / "out8"), "--target-model", str(tmp_path / "target"), "--out",
                     str(tmp_path / "c"), "--steps", "3", "--ttt", "2", "--draft-vocab", "200"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "target from the stored top-8 logprobs" in out
    m = re.search(r"the targets hold ([\d.]+) % of the target's probability in the stored top-8 and ([\d.]+) % "
                  r"within the draft vocabulary", out)
    assert m and float(m.group(2)) <= float(m.group(1)) == pytest.approx(100 * s8["topk_mass"], abs=2.0), out
    assert "WARNING: below 95 %" in out
    assert len(progress(tmp_path / "c")) == 3


def test_target_tensors_from_a_sharded_hf_directory(toy_extraction, tmp_path, capsys):
    from pipeline.errors import UserError
    from pipeline.train.target import load_target

    src = load_file(toy_extraction["target"] / "model.safetensors")
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"lm_head.weight": src["lm_head.weight"], "other": torch.zeros(2)}, hf / "model-00002-of-00002.safetensors")
    save_file({"model.embed_tokens.weight": src["model.embed_tokens.weight"]}, hf / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors", "other": "model-00002-of-00002.safetensors",
                            "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    t = load_target(str(hf), need_norm=False)
    assert torch.equal(t.head, src["lm_head.weight"]) and torch.equal(t.embed, src["model.embed_tokens.weight"])
    with pytest.raises(UserError, match=r"no tensor model.norm.weight \(the files' last slot is pre-norm\)"):
        load_target(str(hf), need_norm=True)
    del index["weight_map"]["model.embed_tokens.weight"]
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    rc = train_main(["--data", str(toy_extraction["out"]), "--target-model", str(hf), "--out", str(tmp_path / "c"),
                     "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no tensor model.embed_tokens.weight" in err


def test_bad_draft_vocabulary_and_pre_norm_last_slot(toy_extraction, tmp_path, capsys):
    args = ["--data", str(toy_extraction["out"]), "--target-model", str(toy_extraction["target"]), "--steps", "1"]
    assert train_main([*args, "--out", str(tmp_path / "a"), "--draft-vocab", "300"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--draft-vocab 300: must be between 1 and the target's vocabulary (256)" in err
    data = copy_data(toy_extraction["out"], tmp_path / "data")
    conn = sqlite3.connect(data / "manifest.sqlite")
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('final_slot', 'pre-norm')")
    conn.commit()
    conn.close()
    assert train_main(["--data", str(data), "--target-model", str(toy_extraction["target"]), "--steps", "1",
                       "--out", str(tmp_path / "b"), "--ttt", "2"]) == 0
    assert "final hidden state (pre-norm) through the target's LM head" in capsys.readouterr().out


def test_loss_mask_travels_from_the_dataset_to_the_training_target(tmp_path):
    from pipeline.extract.dataset import parse_sample
    from pipeline.train.data import load_batch, load_corpus, token_counts
    from pipeline.train.model import DraftConfig, Eagle3Draft, build_target, draft_vocab
    from pipeline.train.target import load_target
    from tests.conftest import eagle3
    from tests.toy import ToyServer

    with pytest.raises(ValueError, match="loss_mask must be a list as long as input_ids"):
        parse_sample(b'{"input_ids": [1, 2, 3], "loss_mask": [1, 0]}')
    with pytest.raises(ValueError, match="only 0 and 1"):
        parse_sample(b'{"input_ids": [1, 2], "loss_mask": [1, 2]}')
    lines = []
    for i in range(6):
        ids = [(7 * i + j) % 256 for j in range(20)]
        lines.append(json.dumps({"input_ids": ids, "loss_mask": [0] * 10 + [1] * 10}))
    lines.append('{"input_ids": [1, 2, 3], "loss_mask": [1]}')
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    server = ToyServer()
    try:
        res = eagle3("extract", "--server", server.url, "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out"))
    finally:
        server.stop()
    conn = sqlite3.connect(tmp_path / "out" / "manifest.sqlite")
    failed = conn.execute("SELECT idx, error FROM samples WHERE status = 'failed'").fetchall()
    conn.close()
    assert failed == [(6, "data line 7: loss_mask must be a list as long as input_ids (3 tokens), it has 1")], res.stderr
    corpus = load_corpus(tmp_path / "out", skip_bad=False, val_share=0.0)
    everything = corpus.train + corpus.val
    t = load_file(everything[0].path)
    assert t["loss_mask"].tolist() == [0] * 10 + [1] * 10
    target = load_target(str(_toy_target(tmp_path)), need_norm=False)
    counts = token_counts(everything, 256)
    assert int(counts.sum()) == 6 * 10  # only the masked-in tokens count toward the draft vocabulary
    cfg = DraftConfig(hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                      intermediate_size=32, vocab_size=256, draft_vocab_size=256)
    m = Eagle3Draft(cfg, target.embed)
    m.set_vocab(*draft_vocab(counts, 256))
    batch = load_batch(everything)
    valid = build_target(batch, m, target.head)["valid"]
    assert valid[:, :9].sum() == 0 and bool(valid[:, 9:19].all()) and valid[:, 19].sum() == 0


def _toy_target(tmp_path: Path) -> Path:
    from pipeline.toy.model import export_target
    return export_target(tmp_path / "target")


def test_a_rank_past_the_visible_gpus_is_refused_in_one_line_by_that_rank(monkeypatch, capsys, tmp_path):
    """Issue 32: on a 1-GPU H200 the demo's 2-process training asked for cuda:1 and died with a CUDA
    traceback. Made to see one GPU, rank 1 says why in one line (rank 0 would say nothing of it)."""
    from pipeline.train.loop import RankDeviceError, rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_device(0) == torch.device("cuda:0")
    with pytest.raises(RankDeviceError, match=r"rank 1 needs cuda:1 but 1 GPU\(s\) are visible; use --nproc-per-node 1"):
        rank_device(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    assert train_main(["--data", str(tmp_path), "--out", str(tmp_path / "c"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train: rank 1 needs cuda:1"), err


def test_the_demo_trains_on_the_cpu_whatever_gpus_the_host_has(tmp_path):
    from pipeline.config import load_workspace
    from pipeline.stages.host import stage_env
    from pipeline.toy.demo_workspace import config_text

    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(config_text(python=sys.executable, port=30000, steps=10))
    assert stage_env(load_workspace(cfg), "train")["CUDA_VISIBLE_DEVICES"] == ""


def test_explicit_aux_ids_reach_the_draft_as_the_server_was_given_them(tmp_path, capsys):
    """Issue 32: a server started with --return-aux-hidden-state-layer-ids 0,2,5 captures, as SGLang's Llama does,
    the inputs of layers 1, 3 and 6 and reports the ids as given; the manifest records them so, and the draft's
    eagle_config carries 0,2,5 — which SGLang, serving it on the same target, maps to the same layers."""
    from safetensors import safe_open

    from pipeline.draft.capture import captured_layers
    from pipeline.toy.model import LAYERS, ToyLM
    from tests.conftest import eagle3
    from tests.toy import ToyServer, write_dataset

    server = ToyServer("--aux-layer-ids", "0,2,5")
    try:
        samples = write_dataset(tmp_path / "d.jsonl", 12, lo=16, hi=40)
        assert eagle3("extract", "--server", server.url, "--data", str(tmp_path / "d.jsonl"), "--out",
                      str(tmp_path / "out")).returncode == 0
    finally:
        server.stop()
    with safe_open(str(tmp_path / "out" / "hidden_states" / "hs_0.safetensors"), "pt") as f:
        meta, rows = f.metadata(), f.get_tensor("hidden_states")[:, :3].float()
    assert json.loads(meta["layer_ids"]) == [0, 2, 5] and meta["layer_convention"] == "sglang-server-ids"
    model = ToyLM()
    ids = samples[0]
    assert torch.allclose(rows, model(ids, capture=[1, 3, 6])[0].float(), atol=2e-2)
    assert not torch.allclose(rows, model(ids)[0].float(), atol=2e-2)  # not the default layers [2, 4, 5]
    _toy_target(tmp_path)
    assert train_main(["--data", str(tmp_path / "out"), "--target-model", str(tmp_path / "target"), "--out",
                       str(tmp_path / "c"), "--steps", "2", "--ttt", "2", "--token-budget", "1024"]) == 0
    exported = json.loads((tmp_path / "c" / "draft" / "config.json").read_text())["eagle_config"]
    assert exported["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert captured_layers(exported["eagle_aux_hidden_state_layer_ids"], LAYERS) == [1, 3, 6]


def _hf_dir(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A Hugging Face directory: config.json and two shards named by model.safetensors.index.json."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, path / shard)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    return path


# Config keys as the model cards give them (no download); sizes shrunk to the toy data's hidden 64 and vocabulary 256.
KIMI_K25_TEXT = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 160,
                 "moe_intermediate_size": 32, "num_hidden_layers": 8, "vocab_size": 256, "rms_norm_eps": 1e-6,
                 "rope_theta": 50000.0, "max_position_embeddings": 262144,
                 "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
LLAMA_31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 160, "num_hidden_layers": 8, "vocab_size": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}


@pytest.mark.parametrize("layout", ["kimi-k2.5", "llama-3.1", "tied"])
def test_real_target_layouts_train_export_and_load(layout, toy_extraction, tmp_path, capsys):
    """Issue 32: tiny directories in Kimi-K2.5's layout (text model under text_config, tensors under
    language_model., MLA fields without head_dim, yarn RoPE) and Llama-3.1's (llama3 RoPE, GQA; and with tied
    embeddings) train 3 steps, export, and pass SGLang's load rules."""
    from pipeline.draft.sglang import check_export

    src = load_file(toy_extraction["target"] / "model.safetensors")
    embed, head, norm = src["model.embed_tokens.weight"], src["lm_head.weight"], src["model.norm.weight"]
    if layout == "kimi-k2.5":
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "tie_word_embeddings": False, "text_config": KIMI_K25_TEXT, "vision_config": {"hidden_size": 32}}
        tensors = {"language_model.model.embed_tokens.weight": embed, "language_model.lm_head.weight": head,
                   "language_model.model.norm.weight": norm, "vision_tower.patch_embed.weight": torch.zeros(4, 4)}
    elif layout == "llama-3.1":
        config, tensors = LLAMA_31, {"model.embed_tokens.weight": embed, "lm_head.weight": head,
                                     "model.norm.weight": norm}
    else:
        config, tensors = {**LLAMA_31, "tie_word_embeddings": True}, {"model.embed_tokens.weight": head,
                                                                      "model.norm.weight": norm}
    target = _hf_dir(tmp_path / "target", config, tensors)
    assert train_main(["--data", str(toy_extraction["out"]), "--target-model", str(target), "--out",
                       str(tmp_path / "c"), "--steps", "3", "--ttt", "2", "--token-budget", "1024"]) == 0
    out = capsys.readouterr().out
    assert check_export(tmp_path / "c" / "draft") == []
    exported = json.loads((tmp_path / "c" / "draft" / "config.json").read_text())
    if layout == "kimi-k2.5":
        # SpecForge's Kimi-K2.5 draft (issue 51): 64 heads × 128 per 7168 of hidden (1 here), KV heads = heads,
        # MLP 18,432 per 7168 (at least 128), served at RoPE θ 1e6 unscaled whatever the target's yarn
        assert "draft layer: 1 heads × 128, 1 KV heads, MLP 128 (a Kimi-K2 target: SpecForge's Kimi-K2.5" in out
        assert exported["rope_theta"] == 1e6 and exported["rope_scaling"] is None and exported["head_dim"] == 128
        assert "loads at tensor-parallel sizes 1; WARNING: not at TP 2: 1 attention heads" in out  # the toy's 1 head
    else:
        assert "draft layer: 4 heads × 16, 2 KV heads, MLP 160 (the target's attention and MLP)" in out
        assert exported["rope_scaling"] == LLAMA_31["rope_scaling"] and exported["rope_theta"] == 500000.0


def test_max_length_cuts_long_samples_and_grad_accum_takes_the_next_batches(toy_extraction, tmp_path, capsys):
    """Issue 32: samples past --max-length are cut (and counted); with --grad-accum 2 step 1 is batches 1 and 2
    (at lr 0 its loss is the mean of a 1-batch run's steps 1 and 2)."""
    common = ["--data", str(toy_extraction["out"]), "--target-model", str(toy_extraction["target"]), "--ttt", "2",
              "--token-budget", "512", "--max-length", "64", "--lr", "0"]
    assert train_main([*common, "--out", str(tmp_path / "a"), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    lengths = [len(s) for s in toy_extraction["samples"]]
    assert f"train: {sum(n > 64 for n in lengths)} sample(s) longer than --max-length 64 tokens cut to it" in out
    assert train_main([*common, "--out", str(tmp_path / "b"), "--steps", "1", "--grad-accum", "2"]) == 0
    one, two = progress(tmp_path / "a"), progress(tmp_path / "b")
    assert two[0]["loss"] == pytest.approx((one[0]["loss"] + one[1]["loss"]) / 2, rel=1e-4)
    assert train_main([*common[:-4], "--token-budget", "512", "--max-length", "1024", "--out", str(tmp_path / "c"),
                       "--steps", "1"]) == 2
    assert "--max-length 1024 is more than --token-budget 512" in capsys.readouterr().err


def test_epochs_set_the_steps_and_the_export_guards_the_context_it_was_trained_at(toy_extraction, tmp_path, capsys):
    """Issue 51: --epochs beside --steps (SpecForge's default when neither is given); the exported config records
    the training max length, and export warns that the target serves longer contexts (the toy's 2,048)."""
    from pipeline.train.data import batches, load_corpus
    from pipeline.train.export import TRAIN_MAX_LENGTH_KEY, context_warning

    rc = train_main(["--data", str(toy_extraction["out"]), "--target-model", str(toy_extraction["target"]), "--out",
                     str(tmp_path / "c"), "--epochs", "0.25", "--ttt", "2", "--token-budget", "512", "--max-length",
                     "256"])
    out = capsys.readouterr().out
    assert rc == 0, out
    corpus = load_corpus(toy_extraction["out"], skip_bad=False, max_length=256)
    per_rank = len(batches(corpus.train, budget=512, seed=0, epoch=0))
    steps = -(-per_rank // 4)  # ceil(0.25 × batches)
    assert f"train: 0.25 epoch(s) of {per_rank} batch(es) per rank, --grad-accum 1: {steps} steps" in out, out
    assert len(progress(tmp_path / "c")) == steps
    exported = json.loads((tmp_path / "c" / "draft" / "config.json").read_text())
    assert exported[TRAIN_MAX_LENGTH_KEY] == 256 and exported["max_position_embeddings"] == 2048
    assert "train: WARNING: the draft was trained on samples of up to 256 tokens and the target serves contexts of " \
           "up to 2,048" in out
    assert context_warning(tmp_path / "c" / "draft", served_context=200) is None
    assert train_main(["--data", "d", "--out", str(tmp_path / "o"), "--steps", "2", "--epochs", "1"]) == 2
    assert "train: give --steps or --epochs, not both" in capsys.readouterr().err
