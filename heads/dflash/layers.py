"""DFlash's draft layer: attention whose queries are the block's slots and whose keys and values are the target's
fused context features followed by the block itself (one KV projection for both), then a SwiGLU MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.layers import RMSNorm, apply_rope, rope_tables
from heads.train_attention import StructuredMask, attend


class DFlashAttention(nn.Module):
    """Qwen3-style attention (per-head q/k norms, grouped key/value heads) whose keys are the context's and the
    block's. Parameter names follow the anchors' checkpoints (``self_attn.q_proj`` ...)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, theta: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"drafter.num_kv_heads={num_kv_heads} must divide drafter.num_heads={num_heads}")
        self.h, self.g, self.hd, self.theta = num_heads, num_kv_heads, head_dim, theta
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def keys(self, x_BND: Tensor, pos: Tensor, tables: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """(k, v) [B, g, N, hd] of ``x`` at positions ``pos`` ([N] or [B, N]), rotated (``tables``: the rotary
        tables of ``pos`` when the caller has them already)."""
        B, N, _ = x_BND.shape
        k = self.k_norm(self.k_proj(x_BND).view(B, N, self.g, self.hd)).transpose(1, 2)
        v = self.v_proj(x_BND).view(B, N, self.g, self.hd).transpose(1, 2)
        cos, sin = tables or rope_tables(pos, self.hd, self.theta, k.dtype, k.device)
        return apply_rope(k, cos, sin), v

    def _queries(self, x_BSD: Tensor, pos: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        B, S, _ = x_BSD.shape
        q = self.q_norm(self.q_proj(x_BSD).view(B, S, self.h, self.hd)).transpose(1, 2)
        tables = rope_tables(pos, self.hd, self.theta, q.dtype, q.device)  # shared by the block's keys
        return apply_rope(q, *tables), tables

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | StructuredMask | None) -> Tensor:
        """Decoding passes a dense mask (or None); training a ``StructuredMask`` (``heads.train_attention``)."""
        B, _, S, _ = q.shape
        if self.g != self.h:
            k, v = k.repeat_interleave(self.h // self.g, 1), v.repeat_interleave(self.h // self.g, 1)
        if isinstance(mask, StructuredMask):
            out = attend(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))

    def forward(self, x_BSD: Tensor, pos: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor | None) -> Tensor:
        q, tables = self._queries(x_BSD, pos)
        k, v = self.keys(x_BSD, pos, tables)
        return self._attend(q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), mask)

    def forward_in_place(self, x_BSD: Tensor, pos: Tensor, k_buf: Tensor, v_buf: Tensor, cols: Tensor,
                         mask: Tensor) -> Tensor:
        """``forward`` for a decoder's key / value buffers [B, g, C, hd]: the block's keys are written into them at
        columns ``cols`` [S] (beside the cached context) and attention runs over the whole buffers under ``mask``,
        instead of concatenating a copy of the context with the block every call."""
        q, tables = self._queries(x_BSD, pos)
        k, v = self.keys(x_BSD, pos, tables)
        k_buf.index_copy_(2, cols, k.to(k_buf.dtype))
        v_buf.index_copy_(2, cols, v.to(v_buf.dtype))
        return self._attend(q, k_buf.to(q.dtype), v_buf.to(q.dtype), mask)


class DFlashMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, theta: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = DFlashAttention(hidden_size, num_heads, num_kv_heads, head_dim, eps, theta)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = DFlashMLP(hidden_size, intermediate_size)

    def forward(self, h_BSD: Tensor, pos: Tensor, ctx_k: Tensor | None, ctx_v: Tensor | None, mask: Tensor | None,
                ctx_BTD: Tensor | None = None, ctx_pos: Tensor | None = None) -> Tensor:
        if ctx_BTD is not None:  # the context keys from inside this call: a sharded layer (FSDP) has its weights here
            ctx_k, ctx_v = self.self_attn.keys(ctx_BTD, ctx_pos)
        return self.sublayers(h_BSD, lambda x: self.self_attn(x, pos, ctx_k, ctx_v, mask))

    def forward_in_place(self, h_BSD: Tensor, pos: Tensor, k_buf: Tensor, v_buf: Tensor, cols: Tensor,
                         mask: Tensor) -> Tensor:
        """``forward`` over a decoder's key / value buffers (``DFlashAttention.forward_in_place``)."""
        return self.sublayers(h_BSD, lambda x: self.self_attn.forward_in_place(x, pos, k_buf, v_buf, cols, mask))

    def sublayers(self, h_BSD: Tensor, attend) -> Tensor:
        """The residual attention (``attend``: the normed input -> its output) and MLP sublayers (DFlash2 wraps
        each in its block convolutions)."""
        h = h_BSD + attend(self.input_layernorm(h_BSD))
        return h + self.mlp(self.post_attention_layernorm(h))
