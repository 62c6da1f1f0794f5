"""The training-time test's attention at flash speed, with memory linear in the sequence length.

Step k's query at index j attends to the step-0 keys of indices ≤ j (causal) and to its own index's keys
of steps 1..k (the chain it drafted). The first set is ordinary causal attention: a fused flash kernel
computes it with its log-sum-exp (lse₀), never the T×T score matrix. The k diagonal scores t_s = q·d_s
are elementwise. The two are merged exactly through the log-sum-exp:

    out = α·o₀ + Σ_s β_s·u_s,   (α, β_1..β_k) = softmax(lse₀, t_1..t_k)

The backward needs no T×T matrix either. The gradient reaching the step-0 scores, through o₀ and
through lse₀ together, is α·P·(dO·v − dO·out): exactly what the flash kernel's own backward computes when
it is given α·dO as the output gradient and the *merged* output as "its" output (its D term is
rowsum(dO'∘out)). So one flash backward call plus a few elementwise sums give every gradient.

Grouped-query attention: the kernels read K/V with fewer heads than Q (never repeated); the diagonal
terms group the query heads per KV head. Padding: samples are right-padded (`data.load_batch`), so under
the causal mask a real query never sees a padding key; padding rows compute something unused (no loss
reads them, and step k+1 reads only its own index).

The kernels are ATen's: `_scaled_dot_product_flash_attention` on CUDA (FlashAttention-2), its `_for_cpu`
sibling on the CPU (where the tests prove the algebra against the dense reference, forward and gradients).
Where the kernel refuses its inputs (a GPU or a dtype it does not support), a blocked implementation of the
same algebra takes over — exact, memory linear in T, slower — and the trainer says so once in its log.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


CHUNK = 256  # query rows per block of the blocked fallback


def _flash_forward(q, k, v, scale):
    """(out, lse [B, H, T] float32, what the backward needs) of causal attention: ATen's flash kernel, or the
    blocked fallback (`extra` None) where the kernel refuses the inputs (a GPU or dtype it does not support)."""
    try:
        if q.device.type == "cuda":
            res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
            return res[0], res[1], res[2:8]
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()
    except torch.OutOfMemoryError:
        raise  # memory, not support: the fallback would need more of it, slowly
    except RuntimeError as exc:
        _fallback_note(exc)
        return (*_blocked_forward(q, k, v, scale), None)


def _flash_backward(grad, q, k, v, out, lse, extra, scale):
    if extra is None:
        return _blocked_backward(grad, q, k, v, out, lse, scale)
    if q.device.type == "cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True, scale=scale)


_noted: list[str] = []


def _fallback_note(exc: Exception) -> None:
    if not _noted:
        _noted.append(str(exc))
        print(f"train: the flash attention kernel refused these inputs ({str(exc).splitlines()[0][:200]}); using the "
              "blocked attention instead (exact, slower)", flush=True)


def _blocked_scores(q, k, scale, start: int, stop: int):
    """Scores [B, KV, rep, rows, stop] of query rows start..stop against keys 0..stop, causal, float32."""
    kv = k.shape[1]
    s = torch.einsum("bgrtd,bgsd->bgrts", _groups(q[:, :, start:stop], kv).float(), k[:, :, :stop].float()) * scale
    rows = torch.arange(start, stop, device=q.device)[:, None]
    return s.masked_fill(torch.arange(stop, device=q.device)[None, :] > rows, float("-inf"))


def _blocked_forward(q, k, v, scale):
    """Causal attention a block of query rows at a time (memory: a block's rows × T scores), with its lse."""
    B, H, T, D = q.shape
    out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    for start in range(0, T, CHUNK):
        stop = min(T, start + CHUNK)
        s = _blocked_scores(q, k, scale, start, stop)
        m = torch.logsumexp(s, -1)
        o = torch.einsum("bgrts,bgsd->bgrtd", torch.exp(s - m[..., None]), v[:, :, :stop].float())
        out[:, :, start:stop] = o.reshape(B, H, stop - start, D).to(q.dtype)
        lse[:, :, start:stop] = m.reshape(B, H, stop - start)
    return out, lse


def _blocked_backward(grad, q, k, v, out, lse, scale):
    """The flash backward's algebra a block at a time: dS = P ∘ (dO·vᵀ − rowsum(dO ∘ out))."""
    B, H, T, D = q.shape
    kv = k.shape[1]
    dq = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for start in range(0, T, CHUNK):
        stop = min(T, start + CHUNK)
        s = _blocked_scores(q, k, scale, start, stop)
        p = torch.exp(s - _groups(lse[..., None][:, :, start:stop], kv))
        g = _groups(grad[:, :, start:stop], kv).float()
        d = (g * _groups(out[:, :, start:stop], kv).float()).sum(-1, keepdim=True)
        ds = p * (torch.einsum("bgrtd,bgsd->bgrts", g, v[:, :, :stop].float()) - d)
        dq[:, :, start:stop] = (torch.einsum("bgrts,bgsd->bgrtd", ds, k[:, :, :stop].float()) * scale
                                ).reshape(B, H, stop - start, D)
        dk[:, :, :stop] += torch.einsum("bgrts,bgrtd->bgsd", ds, _groups(q[:, :, start:stop], kv).float()) * scale
        dv[:, :, :stop] += torch.einsum("bgrts,bgrtd->bgsd", p, g)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _groups(x: torch.Tensor, kv: int) -> torch.Tensor:
    """[B, H, T, D] → [B, KV, H/KV, T, D] (a view: query heads grouped by the KV head they read)."""
    B, H, T, D = x.shape
    return x.view(B, kv, H // kv, T, D)


def _diag_scores(q: torch.Tensor, dk: torch.Tensor, scale: float) -> torch.Tensor:
    """t [B, KV, rep, T, S] (float32): each query with its own index's keys of steps 1..S."""
    return torch.einsum("bgrtd,bgtsd->bgrts", _groups(q, dk.shape[1]).float(), dk.float()) * scale


def _merge_weights(lse: torch.Tensor, t: torch.Tensor):
    """(α [B, KV, rep, T, 1], β [B, KV, rep, T, S]) = softmax over (lse₀, t_1..t_S)."""
    B, KV, rep, T, _ = t.shape
    w = torch.cat([lse.view(B, KV, rep, T, 1), t], dim=-1).softmax(-1)
    return w[..., :1], w[..., 1:]


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, dk, dv, scale):
        with torch.autocast(q.device.type, enabled=False):  # the merge stays in float32 under bf16 autocast
            return _TTTAttention._forward(ctx, q, k0, v0, dk, dv, scale)

    @staticmethod
    def _forward(ctx, q, k0, v0, dk, dv, scale):
        o0, lse, extra = _flash_forward(q, k0, v0, scale)
        if dk is None:
            out = o0
        else:
            alpha, beta = _merge_weights(lse, _diag_scores(q, dk, scale))
            merged = alpha * _groups(o0, k0.shape[1]).float() + torch.einsum("bgrts,bgtsd->bgrtd", beta, dv.float())
            out = merged.to(q.dtype).reshape(q.shape).contiguous()
        ctx.save_for_backward(q, k0, v0, dk, dv, out, lse)
        ctx.extra, ctx.scale = extra, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _TTTAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k0, v0, dk, dv, out, lse = ctx.saved_tensors
        scale, kv = ctx.scale, k0.shape[1]
        grad_out = grad_out.contiguous()
        if dk is None:
            dq, dk0, dv0 = _flash_backward(grad_out, q, k0, v0, out, lse, ctx.extra, scale)
            return dq, dk0, dv0, None, None, None
        t = _diag_scores(q, dk, scale)
        alpha, beta = _merge_weights(lse, t)
        g = _groups(grad_out, kv).float()
        # the diagonal keys: dt_s = β_s (dO·u_s − dO·out)
        g_u = torch.einsum("bgrtd,bgtsd->bgrts", g, dv.float())
        g_out = (g * _groups(out, kv).float()).sum(-1, keepdim=True)
        dt = beta * (g_u - g_out)
        ddv = torch.einsum("bgrts,bgrtd->bgtsd", beta, g).to(dv.dtype)
        ddk = (torch.einsum("bgrts,bgrtd->bgtsd", dt, _groups(q, kv).float()) * scale).to(dk.dtype)
        dq_diag = torch.einsum("bgrts,bgtsd->bgrtd", dt, dk.float()) * scale
        # the step-0 keys, through o₀ and lse₀ at once (see the module docstring)
        g0 = (alpha * g).to(q.dtype).reshape(q.shape).contiguous()
        dq, dk0, dv0 = _flash_backward(g0, q, k0, v0, out, lse, ctx.extra, scale)
        dq = (dq.float() + dq_diag.reshape(q.shape)).to(q.dtype)
        return dq, dk0, dv0, ddk, ddv, None


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                  diag: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Step len(diag)'s attention.

    q [B, H, T, D]; k0, v0 [B, KV, T, D] the step-0 keys and values; diag[s-1] = (k_s, v_s) [B, KV, T, D] of
    step s. Returns [B, H, T, D].
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    if not diag:
        return _TTTAttention.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), None, None, scale)
    dk = torch.stack([k for k, _ in diag], dim=3)  # [B, KV, T, S, D]
    dv = torch.stack([v for _, v in diag], dim=3)
    return _TTTAttention.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), dk, dv, scale)
