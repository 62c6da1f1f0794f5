"""The EAGLE-3 draft: training-time-test attention, positions, vocabulary maps, export and SGLang's load rules."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.draft.sglang import SglangDraft, check_export, load_rules, read_export
from pipeline.errors import UserError
from pipeline.train.attention import ttt_attention
from pipeline.train.export import NAMES, export_checkpoint
from pipeline.train.model import DraftConfig, Eagle3Draft, build_target, draft_vocab

pytestmark = pytest.mark.timeout(60)


def small_config(**kw) -> DraftConfig:
    base = dict(hidden_size=16, target_hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                intermediate_size=24, vocab_size=40, draft_vocab_size=30, rope_theta=10000.0, max_position_embeddings=64)
    base.update(kw)
    return DraftConfig(**base)


def random_draft(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    g = torch.Generator().manual_seed(seed)
    m = Eagle3Draft(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    counts = torch.randint(0, 100, (cfg.vocab_size,), generator=g)
    m.set_vocab(*draft_vocab(counts, cfg.draft_vocab_size))
    return m.eval()


def test_ttt_attention_on_a_hand_computed_case():
    # one head, D = 1, T = 3, two steps: q of step 1 at index j sees k0[0..j] and k1[j]
    k0 = torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 3, 1)
    v0 = torch.tensor([10.0, 20.0, 30.0]).view(1, 1, 3, 1)
    k1 = torch.tensor([0.5, -1.0, 4.0]).view(1, 1, 3, 1)
    v1 = torch.tensor([-5.0, 7.0, 1.0]).view(1, 1, 3, 1)
    q = torch.tensor([1.0, 0.5, -1.0]).view(1, 1, 3, 1)
    out = ttt_attention(q, k0, v0, [(k1, v1)])[0, 0, :, 0]
    for j in range(3):
        scores = [q.flatten()[j] * k0.flatten()[i] for i in range(j + 1)] + [q.flatten()[j] * k1.flatten()[j]]
        w = torch.tensor(scores).softmax(0)
        values = [v0.flatten()[i] for i in range(j + 1)] + [v1.flatten()[j]]
        assert out[j].item() == pytest.approx(sum(float(a) * float(b) for a, b in zip(w, values, strict=True)), rel=1e-6)
    # step 0 alone is plain causal attention
    out0 = ttt_attention(q, k0, v0, [])[0, 0, 0, 0]
    assert out0.item() == pytest.approx(10.0)


def _export_tensors(m: Eagle3Draft) -> dict:
    return {k: v for k, v in m.state_dict().items() if k in NAMES}


def _sglang_config(cfg: DraftConfig) -> dict:
    from pipeline.train.export import sglang_config
    return sglang_config(cfg.to_dict())


def test_training_unroll_equals_sglang_chain_drafting_with_positions():
    """Step k of the unroll at index c = SGLang's draft-extend over 0..c, then k decode steps at positions c+1..c+k."""
    cfg = small_config()
    m = random_draft(cfg)
    g = torch.Generator().manual_seed(3)
    T, steps = 9, 4
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * cfg.hidden_size, generator=g)
    with torch.no_grad():
        unrolled = m.unroll(aux, tokens, steps)
    loaded, problems = load_rules(_sglang_config(cfg), _export_tensors(m))
    assert problems == []
    sg = SglangDraft(loaded, m.embed_tokens)
    for c in range(T - steps - 1):
        sg.reset()
        idx = torch.arange(c + 1)
        _, h = sg.forward(tokens[0, 1: c + 2], aux[0, : c + 1], idx)
        assert torch.allclose(sg.last_logits[-1], unrolled[0][0, c], atol=1e-4)
        h = h[-1:]
        for k in range(1, steps):
            _, h = sg.forward(tokens[0, c + 1 + k: c + 2 + k], h, torch.tensor([c + k]))  # teacher-forced token
            assert torch.allclose(sg.last_logits[-1], unrolled[k][0, c], atol=1e-4), (c, k)
    # positions matter: a decode step that does not advance its position drafts something else
    sg.reset()
    _, h = sg.forward(tokens[0, 1:4], aux[0, :3], torch.arange(3))
    sg.forward(tokens[0, 4:5], h[-1:], torch.tensor([2]))
    assert not torch.allclose(sg.last_logits[-1], unrolled[1][0, 2], atol=1e-3)


def test_draft_vocabulary_maps_round_trip():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = draft_vocab(counts, 4)
    hot = d2t + torch.arange(4)
    assert hot.tolist() == [0, 2, 3, 5]  # the 4 most frequent, ascending target ids
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == hot.tolist()
    to_draft = {t: d for d, t in enumerate(hot.tolist())}
    assert all(int(hot[to_draft[t]]) == t for t in to_draft)
    d2t, t2d = draft_vocab(counts, 8)  # the whole vocabulary: identity
    assert d2t.tolist() == [0] * 8 and bool(t2d.all())


def test_target_restricted_to_the_draft_vocabulary_and_the_loss_mask():
    cfg = small_config(vocab_size=6, draft_vocab_size=4, hidden_size=4, target_hidden_size=4, head_dim=1)
    m = Eagle3Draft(cfg, torch.zeros(6, 4))
    m.set_vocab(*draft_vocab(torch.tensor([9, 1, 8, 7, 0, 6]), 4))  # draft ids → target 0, 2, 3, 5
    head = torch.eye(6, 4)  # logits of row r = final[r] @ head.T
    final = torch.tensor([[[5.0, 0, 0, 0], [0, 0, 5.0, 0], [0, 5.0, 0, 0], [0, 0, 0, 5.0]]])  # argmax 0, 2, 1, 3
    batch = {"final": final, "mask": torch.ones(1, 4, dtype=torch.bool),
             "loss_mask": torch.tensor([[True, True, False, True]])}
    t = build_target(batch, m, head)
    # row 1 predicts token 2, whose loss mask is 0; row 2's argmax (target 1) is outside the draft
    # vocabulary; row 3 would predict a token past the sample
    assert t["valid"].tolist() == [[True, False, False, False]]
    assert t["top"].tolist() == [[0, 1, -1, 2]]
    assert torch.allclose(t["p"].sum(-1), torch.ones(1, 4))
    assert t["p"][0, 0].argmax() == 0 and t["p"].shape == (1, 4, 4)
    # a pre-norm last slot goes through the target's final norm first
    seen = []
    build_target(batch, m, head, final_norm=lambda x: seen.append(x) or x)
    assert seen and seen[0] is final


def test_topk_target_in_draft_space():
    cfg = small_config(vocab_size=6, draft_vocab_size=3, hidden_size=4, target_hidden_size=4, head_dim=1)
    m = Eagle3Draft(cfg, torch.zeros(6, 4))
    m.set_vocab(*draft_vocab(torch.tensor([0, 5, 0, 5, 5, 0]), 3))  # draft ids → target 1, 3, 4
    batch = {"topk_ids": torch.tensor([[[3, 0], [2, 4]]]), "topk_logprobs": torch.log(torch.tensor([[[0.6, 0.3],
                                                                                                  [0.5, 0.2]]])),
             "mask": torch.ones(1, 2, dtype=torch.bool)}
    t = build_target(batch, m, None)
    assert torch.allclose(t["p"][0, 0], torch.tensor([0.0, 1.0, 0.0]))  # target 0 is outside: renormalised
    assert t["top"].tolist() == [[1, -1]]  # row 1's top (target 2) is outside the draft vocabulary


def _checkpoint(tmp_path, m: Eagle3Draft, cfg: DraftConfig, *, extra: dict | None = None):
    step = tmp_path / "ckpt" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    tensors = {**_export_tensors(m), **(extra or {})}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(step / "model.safetensors"))
    (step / "draft_config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "ckpt" / "latest").write_text("step_3\n")
    return tmp_path / "ckpt"


def test_export_writes_exactly_what_sglang_loads(tmp_path):
    cfg = small_config()
    m = random_draft(cfg)
    out = export_checkpoint(_checkpoint(tmp_path, m, cfg), tmp_path / "draft")
    config, tensors = read_export(out)
    assert set(tensors) == set(NAMES)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 30
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert "target_hidden_size" not in config and "eagle_config" not in config
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert check_export(out) == []


def test_exporter_refuses_a_wrong_name_and_an_old_checkpoint(tmp_path):
    cfg = small_config()
    m = random_draft(cfg)
    ckpt = _checkpoint(tmp_path, m, cfg, extra={"midlayer.self_attn.qkv.weight": torch.zeros(2, 2)})
    with pytest.raises(UserError, match=r"not an SGLang-layout checkpoint .*unknown \['midlayer.self_attn.qkv.weight'\]"):
        export_checkpoint(ckpt, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()
    (ckpt / "checkpoints" / "step_3" / "draft_config.json").unlink()
    with pytest.raises(UserError, match="predates the SGLang draft layout"):
        export_checkpoint(ckpt, tmp_path / "draft")


def test_sglang_rules_name_each_problem():
    cfg = small_config()
    m = random_draft(cfg)
    good = _export_tensors(m)
    config = _sglang_config(cfg)
    bad = dict(good)
    bad["midlayer.self_attn.qkv.weight"] = bad.pop("midlayer.self_attn.q_proj.weight")
    bad["fc.weight"] = torch.zeros(16, 32)
    del bad["d2t"]
    _, problems = load_rules(config, bad)
    text = "\n".join(problems)
    assert "midlayer.self_attn.qkv.weight: SGLang has no parameter for it" in text
    assert "fc.weight: shape [16, 32], SGLang expects [16, 48]" in text
    assert "qkv_proj.weight: shards ['q'] missing" in text
    assert "d2t: missing" in text
    _, problems = load_rules({**config, "architectures": ["LlamaForCausalLM"]}, good)
    assert any("architectures" in p for p in problems)
    cfg2 = dict(config)
    del cfg2["rope_theta"]
    assert "config.json: no rope_theta" in load_rules(cfg2, good)[1]
    # `layers.0.*` is accepted for `midlayer.*`, as SGLang does
    renamed = {k.replace("midlayer", "layers.0"): v for k, v in good.items()}
    assert load_rules(config, renamed)[1] == []


def test_gqa_and_rope_shapes_in_the_export(tmp_path):
    cfg = small_config(num_attention_heads=4, num_key_value_heads=1)
    m = random_draft(cfg)
    out = export_checkpoint(_checkpoint(tmp_path, m, cfg), tmp_path / "draft")
    t = load_file(out / "model.safetensors")
    assert list(t["midlayer.self_attn.q_proj.weight"].shape) == [16, 32]
    assert list(t["midlayer.self_attn.k_proj.weight"].shape) == [4, 32]
    assert check_export(out) == []
    assert math.isclose(json.loads((out / "config.json").read_text())["rope_theta"], 10000.0)


def test_training_done_names_the_draft_and_the_launch_line(tmp_path):
    from pipeline.train.export import draft_note

    argv = ["/opt/venv/bin/torchrun", "-m", "pipeline.train", "--target-model", "models/t", "--out", "ckpt"]
    assert draft_note(tmp_path / "ckpt", argv, cwd=tmp_path) == ""  # nothing exported (yet)
    (tmp_path / "ckpt" / "draft").mkdir(parents=True)
    (tmp_path / "ckpt" / "draft" / "config.json").write_text("{}")
    note = draft_note(tmp_path / "ckpt", argv, cwd=tmp_path)
    assert f"draft for SGLang: {tmp_path / 'ckpt' / 'draft'}" in note
    assert f"--model-path {tmp_path / 'models' / 't'} --speculative-algorithm EAGLE3" in note
    assert "--enable-return-aux-hidden-states" not in note


def test_rope_scaling_is_trained_as_served_and_changes_the_drafts_logits():
    """Issue 32: a Llama-3.1-style llama3 scaling is applied by the trainer and by eval-draft's SGLang forward alike
    (their logits agree), is exported, and changing only `rope_scaling` changes eval-draft's logits."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    cfg = small_config(rope_scaling=scaling)
    m = random_draft(cfg)
    g = torch.Generator().manual_seed(5)
    T = 12
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * cfg.hidden_size, generator=g)
    with torch.no_grad():
        unrolled = m.unroll(aux, tokens, 1)[0][0]
    config = _sglang_config(cfg)
    assert config["rope_scaling"] == scaling

    def served(c: dict) -> torch.Tensor:
        loaded, problems = load_rules(c, _export_tensors(m))
        assert problems == []
        sg = SglangDraft(loaded, m.embed_tokens)
        sg.forward(tokens[0, 1:], aux[0, : T - 1], torch.arange(T - 1))
        return sg.last_logits

    assert torch.allclose(served(config), unrolled[: T - 1], atol=1e-4)
    assert not torch.allclose(served({**config, "rope_scaling": None}), unrolled[: T - 1], atol=1e-2)
    _, problems = load_rules({**config, "rope_scaling": {"rope_type": "longrope"}}, _export_tensors(m))
    assert any("rope type 'longrope' is not one the draft can be trained with" in p for p in problems)
