"""Building blocks every feature drafter shares (EAGLE-1/3, P-EAGLE, DFlash, DSpark): the reduced draft vocabulary's
maps, the rotary embedding, an RMS norm in float32, and the Llama-style draft layer whose attention the caller runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def vocab_maps(token_counts_V: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t [Vd], t2d [V]): the ``draft_vocab_size`` most frequent target ids (ties: lower id), in increasing id
    order; ``d2t[i]`` is draft index i's target id (absolute, not EAGLE's offset form; an exporter converts) and
    ``t2d[j]`` target id j's draft index, or -1 when it is outside the draft vocabulary."""
    V = token_counts_V.shape[0]
    order = sorted(range(V), key=lambda j: (-int(token_counts_V[j]), j))[:draft_vocab_size]
    d2t = torch.tensor(sorted(order), dtype=torch.long)
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(draft_vocab_size)
    return d2t, t2d


def rope_tables(positions: Tensor, hd: int, theta: float, dtype: torch.dtype, device: torch.device
                 ) -> tuple[Tensor, Tensor]:
    """(cos, sin) of the rotary embedding at ``positions`` [n] ([n, hd]), or [B, n] ([B, 1, n, hd]: each row its own
    positions, the batched decoder's ragged rows). Made once per layer call, shared by queries and keys."""
    # compiled (trainer.compile), the frequencies are traced like any op: dynamo does not trace a cache
    inv_freq = (_inv_freq.__wrapped__ if torch.compiler.is_compiling() else _inv_freq)(hd, theta, device)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [(B,) n, hd]
    cos, sin = angles.cos(), angles.sin()
    if dtype != torch.float32:
        cos, sin = cos.to(dtype), sin.to(dtype)
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (rotate-half form) of x [..., n, hd] with ``rope_tables``' cos and sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@functools.lru_cache(maxsize=16)
def _inv_freq(hd: int, theta: float, device: torch.device) -> Tensor:
    """The rotary frequencies, each twice ([hd]: the rotate-half form's two halves), made once per (size, base,
    device) instead of on every call."""
    half = theta ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
    return torch.cat([half, half])


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (bf16 inputs under autocast would otherwise miss the fused kernel and lose
    precision), returned in the input's dtype."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # the same arithmetic, one fused call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class DraftLayer(nn.Module):
    """A Llama-style decoder layer whose attention input may be wider than its hidden size (EAGLE-3: 2D). The
    caller does the attention itself (``qkv`` then ``finish``), since the TTT and tree masks are its business."""

    def __init__(self, in_size: int, hidden_size: int, num_heads: int, intermediate_size: int, theta: float):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"drafter.num_heads={num_heads} must divide the target's hidden size {hidden_size}")
        self.num_heads, self.head_dim, self.theta = num_heads, hidden_size // num_heads, theta
        self.q_proj = nn.Linear(in_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(in_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(in_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=1e-6)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def qkv(self, x_BTI: Tensor, positions_T: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self._project(x_BTI)
        cos, sin = self.rope_tables(positions_T, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) at ``positions`` (``rope_tables``); a static draft step makes them once for every position
        and indexes rows, which gives the same values."""
        return rope_tables(positions, self.head_dim, self.theta, dtype, positions.device)

    def qkv_rotated(self, x_BTI: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``qkv`` with the rotary tables given (rows of ``rope_tables``, broadcast over heads)."""
        q, k, v = self._project(x_BTI)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _project(self, x_BTI: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x_BTI.shape
        split = lambda y: y.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        return split(self.q_proj(x_BTI)), split(self.k_proj(x_BTI)), split(self.v_proj(x_BTI))

    def finish(self, attn_BhTd: Tensor, residual_BTD: Tensor) -> Tensor:
        B, _, T, _ = attn_BhTd.shape
        h = residual_BTD + self.o_proj(attn_BhTd.transpose(1, 2).reshape(B, T, -1))
        y = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
