"""EAGLE training-time-test attention on a CPU, from explicit scores (``heads.eagle``'s ``_ttt_attention`` picks it
for TTT steps j >= 1 of short right-padded rows; GPUs and long sequences keep ``heads.train_attention``'s kernels)."""

from __future__ import annotations

import torch
from torch import Tensor

from heads.train_attention import ttt_step_mask

# Training attention on a CPU: explicit scores (``explicit_ttt_attention``) while B x h x T x (T + steps) stays
# below this (64 MB of float32 scores per step; the toy target's 8 x 4 x 256 x 259 is 2.1M) and T below
# EXPLICIT_MAX_SEQ; above either, and on GPUs, ``heads.train_attention``'s kernels, which never hold a [T, T] tensor.
# (TTT 3 at the toy target's shapes, B 8, h 4, T 256, hd 64, fwd + bwd at 1 thread, scripts/bench_train_attention.py:
# steps 1 and 2 take 126 and 136 ms here, 133 and 200 tiled, 171 and 285 dense; the tiles spend a [TILE, TILE]
# block on each earlier step's one visible key.)
EXPLICIT_ATTENTION_ELEMENTS = 1 << 24
EXPLICIT_MAX_SEQ = 512


def explicit_ttt_attention(q_BhTd: Tensor, keys: list[tuple[Tensor, Tensor]]) -> Tensor:
    """``_ttt_attention`` from explicit float32 scores: [B, h, T, T] over step 0's keys, causal (masked in place: no
    mask tensor), plus one column per earlier step i >= 1 (q . k_i at the same position); one softmax over both, then
    P0 @ v0 + sum_i p_i v_i. For right-padded rows (training's): padded keys are never visible to a real query under
    causal order, and a padded query's output is never read. Step j thus
    costs T + j scores per query where the fused kernel over ``ttt_mask``'s (j+1)T columns computes (j+1)T. Float32
    like the fused kernel's accumulation; the result in ``q``'s dtype. Backward is written out (``_ExplicitTTT``):
    autograd's would zero-fill a [B, h, T, T + j] gradient per slice of the weights."""
    ks, vs = [k for k, _ in keys], [v for _, v in keys]
    with torch.autocast(q_BhTd.device.type, enabled=False):
        return _ExplicitTTT.apply(q_BhTd, *ks, *vs)


class _ExplicitTTT(torch.autograd.Function):
    """out = P0 @ v0 + sum_i p_i v_i with [P0, p_1..p_j] = softmax([q k0^T (masked), q . k_1, .., q . k_j] / sqrt(d));
    backward as in FlashAttention: dS = P * (dP - rowsum(dO * out)), one [B, h, T, T + j] buffer (P) saved."""

    @staticmethod
    def forward(ctx, q_BhTd: Tensor, *kv: Tensor) -> Tensor:
        n = len(kv) // 2
        ks, vs = [k.float() for k in kv[:n]], [v.float() for v in kv[n:]]
        T, scale = q_BhTd.shape[2], q_BhTd.shape[-1] ** -0.5
        q = q_BhTd.float()
        weights = torch.empty(*q.shape[:3], T + n - 1, dtype=torch.float32, device=q.device)
        torch.matmul(q, ks[0].transpose(-1, -2), out=weights[..., :T])
        for i in range(1, n):
            weights[..., T + i - 1] = (q * ks[i]).sum(-1)
        weights.mul_(scale)
        # Causal softmax without a mask tensor: scores relative to the query's own key (always visible), the future
        # zeroed by tril_ (so the row max is the visible max, own key included), exponentiated, the future zeroed again.
        own = weights[..., :T].diagonal(dim1=-2, dim2=-1).clone()
        weights.sub_(own[..., None])
        weights[..., :T].tril_()
        weights.sub_(weights.amax(-1, keepdim=True)).exp_()
        weights[..., :T].tril_()
        weights.div_(weights.sum(-1, keepdim=True))
        out = weights[..., :T] @ vs[0]
        for i in range(1, n):
            out.addcmul_(weights[..., T + i - 1, None], vs[i])
        ctx.save_for_backward(q, weights, out, *ks, *vs)
        ctx.dtypes = (q_BhTd.dtype, *(t.dtype for t in kv))
        return out.to(q_BhTd.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, weights, out, *kv = ctx.saved_tensors
        n = len(kv) // 2
        ks, vs = kv[:n], kv[n:]
        T, scale = q.shape[2], q.shape[-1] ** -0.5
        d_out = grad_out.float()
        delta = (d_out * out).sum(-1, keepdim=True)  # rowsum(P * dP)
        d_scores = torch.empty_like(weights)
        torch.matmul(d_out, vs[0].transpose(-1, -2), out=d_scores[..., :T])
        dvs = [weights[..., :T].transpose(-1, -2) @ d_out]
        for i in range(1, n):
            d_scores[..., T + i - 1] = (d_out * vs[i]).sum(-1)
            dvs.append(weights[..., T + i - 1, None] * d_out)
        d_scores.sub_(delta).mul_(weights).mul_(scale)  # masked entries: weight 0, gradient 0
        d_q = d_scores[..., :T] @ ks[0]
        dks = [d_scores[..., :T].transpose(-1, -2) @ q]
        for i in range(1, n):
            d_col = d_scores[..., T + i - 1, None]
            d_q.addcmul_(d_col, ks[i])
            dks.append(d_col * q)
        grads = [d_q, *dks, *dvs]
        return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes))


def ttt_mask(attn_BT: Tensor, steps: int) -> Tensor:
    """[B, 1, T, steps*T] bool, ``heads.train_attention.ttt_step_mask`` as a dense tensor: query t may see step 0's
    keys <= t that are real tokens (and always its own, so a padded query is never left with no key), and, in block
    i >= 1, step i's key at t itself. Step j uses the first (j+1)*T columns."""
    return ttt_step_mask(attn_BT, steps - 1, right_padded=False).dense(attn_BT.device)
