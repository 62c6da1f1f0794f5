"""The fast trainer equals the reference one (tests/support/reference_train.py) on the CPU: attention, target and
loss, in forward values and gradients, on shapes with padding, grouped-query attention and a loss mask; and a
short training run matches step for step."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.train.attention import ttt_attention
from pipeline.train.model import (
    DraftConfig,
    Eagle3Draft,
    TargetHead,
    build_target,
    draft_vocab,
)
from tests.support import reference_train as ref

pytestmark = pytest.mark.timeout(60)

B, T, STEPS = 3, 13, 4
LENGTHS = (13, 9, 5)  # right-padded, as data.load_batch pads


def _padded_mask() -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]


@pytest.fixture(params=["flash", "blocked"])
def kernel(request, monkeypatch):
    """The ATen flash kernel, or the blocked fallback a refused kernel leaves (small blocks: several per row)."""
    if request.param == "blocked":
        from types import SimpleNamespace

        from pipeline.train import attention

        def refuse(*_a, **_k):
            raise RuntimeError("no kernel for these inputs (a test's)")

        monkeypatch.setattr(attention, "aten", SimpleNamespace(_scaled_dot_product_flash_attention_for_cpu=refuse))
        monkeypatch.setattr(attention, "CHUNK", 4)
    return request.param


def test_attention_equals_the_dense_reference_in_values_and_gradients(kernel):
    g = torch.Generator().manual_seed(1)
    H, KV, D = 6, 2, 8  # three query heads per KV head
    mask = _padded_mask()
    real_rows = mask[:, None, :, None]

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).requires_grad_()

    q = leaf(B, H, T, D)
    ks = [leaf(B, KV, T, D) for _ in range(STEPS)]
    vs = [leaf(B, KV, T, D) for _ in range(STEPS)]
    for s in range(STEPS):
        new = ttt_attention(q, ks[0], vs[0], list(zip(ks[1:s + 1], vs[1:s + 1], strict=True)))
        old = ref.ttt_attention(q, [(k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1))
                                    for k, v in zip(ks[: s + 1], vs[: s + 1], strict=True)], mask)
        assert new.shape == old.shape
        assert torch.allclose(new * real_rows, old * real_rows, atol=1e-5), s
        weight = torch.randn(new.shape, generator=g) * real_rows  # a loss that reads real rows only
        leaves = [q, *ks[: s + 1], *vs[: s + 1]]
        for a, b in zip(torch.autograd.grad((new * weight).sum(), leaves),
                        torch.autograd.grad((old * weight).sum(), leaves), strict=True):
            assert torch.allclose(a, b, atol=1e-5), s


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs it on one)")
def test_attention_on_a_gpu_equals_the_reference_in_bf16():
    """The CUDA branch (FlashAttention-2 through ATen, GQA unrepeated) against the float32 reference."""
    g = torch.Generator().manual_seed(2)
    H, KV, D, n = 8, 2, 128, 3
    mask = _padded_mask()
    q = torch.randn(B, H, T, D, generator=g)
    ks = [torch.randn(B, KV, T, D, generator=g) for _ in range(n)]
    vs = [torch.randn(B, KV, T, D, generator=g) for _ in range(n)]

    def leaves(dtype, device):
        return [t.to(device, dtype).requires_grad_() for t in (q, *ks, *vs)]

    fast, dense = leaves(torch.bfloat16, "cuda"), leaves(torch.float32, "cpu")
    new = ttt_attention(fast[0], fast[1], fast[1 + n], list(zip(fast[2:1 + n], fast[2 + n:], strict=True)))
    old = ref.ttt_attention(dense[0], [(k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1))
                                      for k, v in zip(dense[1:1 + n], dense[1 + n:], strict=True)], mask)
    rows = mask[:, None, :, None]
    assert torch.allclose(new.float().cpu() * rows, old * rows, atol=3e-2)
    weight = torch.randn(old.shape, generator=g) * rows
    (new.float().cpu() * weight).sum().backward()
    (old * weight).sum().backward()
    for a, b in zip(fast, dense, strict=True):
        assert torch.allclose(a.grad.float().cpu(), b.grad, atol=5e-2, rtol=5e-2)


def test_out_of_memory_is_not_taken_for_an_unsupported_kernel(monkeypatch):
    """A refused kernel falls back; running out of memory is raised as it is (the fallback needs more)."""
    from types import SimpleNamespace

    from pipeline.train import attention

    def oom(*_a, **_k):
        raise torch.OutOfMemoryError("out of memory (a test's)")

    monkeypatch.setattr(attention, "aten", SimpleNamespace(_scaled_dot_product_flash_attention_for_cpu=oom))
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(torch.OutOfMemoryError):
        ttt_attention(q, torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), [])


def _config(**kw) -> DraftConfig:
    base = dict(hidden_size=16, target_hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=24, vocab_size=50, draft_vocab_size=20, rope_theta=10000.0,
                max_position_embeddings=64)
    return DraftConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def setup():
    """A small draft with GQA, a padded batch with a loss mask, and the target's head."""
    g = torch.Generator().manual_seed(7)
    cfg = _config()
    m = Eagle3Draft(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0))
    m.set_vocab(*draft_vocab(torch.randint(0, 100, (cfg.vocab_size,), generator=g), cfg.draft_vocab_size))
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    mask = _padded_mask()
    loss_mask = mask & (torch.rand(B, T, generator=g) > 0.3)
    batch = {"token_ids": torch.randint(0, cfg.vocab_size, (B, T), generator=g) * mask,
             "aux": torch.randn(B, T, 3 * cfg.hidden_size, generator=g) * mask[..., None],
             "final": torch.randn(B, T, cfg.hidden_size, generator=g) * 3 * mask[..., None],
             "mask": mask, "loss_mask": loss_mask}
    return m, head, batch


def test_target_equals_the_full_vocabulary_product(setup, monkeypatch):
    m, head, batch = setup
    monkeypatch.setattr(TargetHead, "CHUNK", 7)  # 50 rows in 8 chunks: the argmax is taken across chunks
    new, old = build_target(batch, m, head), ref.build_target(batch, m, head)
    assert torch.equal(new["valid"], old["valid"]) and torch.equal(new["top"], old["top"])
    assert torch.allclose(new["p"], old["p"], atol=1e-6)
    assert 0 < int(new["valid"].sum()) < int(batch["mask"].sum())  # the loss mask and the draft vocabulary bite
    # ties go to the lower id, as a full-vocabulary argmax's
    twin = head.clone()
    twin[45] = twin[3]
    final = twin[3:4].clone().view(1, 1, -1) * 50
    assert TargetHead(twin, m).argmax(final).item() == 3


def test_loss_and_gradients_equal_the_reference(setup):
    m, head, batch = setup
    tgt = build_target(batch, m, head)
    new_m, old_m = copy.deepcopy(m).train(), copy.deepcopy(m).train()
    loss, ent, acc = new_m(batch, tgt, steps=STEPS)
    old_loss, old_ent, old_acc = ref.step_losses(ref.unroll(old_m, batch["aux"], batch["token_ids"], batch["mask"],
                                                            STEPS), tgt)
    assert torch.allclose(loss, old_loss, atol=1e-5) and torch.allclose(ent, old_ent, atol=1e-5)
    assert acc.tolist() == [list(a) for a in old_acc]
    loss.backward()
    old_loss.backward()
    for (name, a), b in zip(new_m.named_parameters(), old_m.parameters(), strict=True):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-5), name


def test_under_bf16_autocast_the_kernel_gets_one_dtype(setup, monkeypatch):
    """On a GPU the step runs under bf16 autocast, where RoPE's float32 tables would promote q and k to float32
    beside a bf16 v: the flash kernel refuses mixed dtypes. The CPU's autocast shows the same."""
    from pipeline.train import attention

    m, head, batch = setup
    seen = []
    real = attention._flash_forward
    monkeypatch.setattr(attention, "_flash_forward", lambda q, k, v, scale: (seen.append((q.dtype, k.dtype, v.dtype))
                                                                             or real(q, k, v, scale)))
    monkeypatch.setattr(attention, "_fallback_note", lambda exc: pytest.fail(f"fell back: {exc}"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = copy.deepcopy(m)(batch, build_target(batch, m, head), steps=2)[0]
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen) and torch.isfinite(loss)


def test_a_short_training_run_matches_step_for_step(setup):
    m, head, batch = setup
    tgt = build_target(batch, m, head)
    runs = []
    for forward in ("new", "old"):
        model = copy.deepcopy(m).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            if forward == "new":
                loss = model(batch, tgt, steps=STEPS)[0]
            else:
                loss = ref.step_losses(ref.unroll(model, batch["aux"], batch["token_ids"], batch["mask"], STEPS),
                                       tgt)[0]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            losses.append(loss.item())
        runs.append(losses)
    assert runs[0][-1] < runs[0][0]  # it learns
    assert runs[0] == pytest.approx(runs[1], abs=1e-5)


def test_the_gpu_benchmark_runs_its_tiny_shape_on_the_cpu(capsys):
    """bench/gpu_train.py drives the trainer's own loader and step; its tiny shape keeps it from rotting."""
    import json

    from bench import gpu_train

    assert gpu_train.main(["--shape", "tiny", "--steps", "2", "--warmup", "1", "--profile-steps", "1",
                           "--token-budget", "128", "--length", "32", "--single-length", "128", "--files", "4",
                           "--workers", "1"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["shape"] == "tiny" and r["tokens_per_s"] > 0 and r["flops_per_token"] > 0
    assert set(r["phases"]) == {"load", "host_to_device", "target", "forward", "backward", "optimizer"}
    assert sum(r["phases"].values()) == pytest.approx(1.0, abs=0.01)
    # the analytic count at the Llama-3.1-8B shape: ~17.4 GFLOP a token (9,000 tokens/s = 20 % of 790)
    s = gpu_train.SHAPES["llama-3.1-8b"]
    assert gpu_train.flops_per_token(s, draft_vocab=32000, ttt=7, length=2048) == pytest.approx(17.4e9, rel=0.02)
