"""DFlash2's dynamic block convolutions and the draft layer they wrap.

A two-tap depthwise convolution over block slots, around the input and around the output of every attention and MLP
sublayer (``BlockConv``): slot t's output is k_{t,0} ⊙ x_t + k_{t,1} ⊙ x_{t-1}, where the kernels k_t = base + Δ(x_t)
are a learned base kernel plus a correction projected from the sublayer's normed input at t and shared by the
channels of a group (``conv_group_size``). One projection gives both sides' kernels (input and output). The taps
never cross a block boundary: slot 0 (the anchor) reads zeros before it, slot 1 reads the anchor. The base kernel
starts at [1, 0] and the projection at zero, so an untrained DFlash2 layer is DFlash's layer exactly.

Shapes: B rows, L = N * S positions (N blocks of S slots, flattened as the layers see them), D hidden size,
K taps (``conv_kernel_size``), G groups (D / ``conv_group_size``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.dflash.layers import DFlashLayer


class BlockConv(nn.Module):
    """The convolutions of one sublayer: ``base_kernel`` [2 sides, K, D] and ``kernel_projection`` (D -> 2 * K * G),
    the names the published DFlash2 checkpoints use."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int = 2, group_size: int = 16):
        super().__init__()
        if kernel_size < 1 or kernel_size > block_size:
            raise ValueError(f"drafter.conv_kernel_size={kernel_size} must be in 1..block_size={block_size}")
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"drafter.conv_group_size={group_size} must divide the hidden size {hidden_size}")
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0  # the identity: slot t's own features, nothing of the slot before
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def kernels(self, x_BLD: Tensor) -> Tensor:
        """[B, L, 2, K, D] every slot's kernels (both sides) from the sublayer's normed input."""
        B, L, _ = x_BLD.shape
        delta = self.kernel_projection(x_BLD).view(B, L, 2, self.kernel_size, -1)
        return self.base_kernel.to(x_BLD.dtype) + delta.repeat_interleave(self.group_size, -1)

    def forward(self, x_BLD: Tensor, kernels: Tensor, side: int) -> Tensor:
        """``x`` convolved over the slots of each block with ``kernels``' side 0 (input) or 1 (output)."""
        B, L, D = x_BLD.shape
        S = self.block_size
        blocks = x_BLD.reshape(B, L // S, S, D)
        out = kernels[:, :, side, 0] * x_BLD
        for j in range(1, self.kernel_size):  # tap j reads slot t - j of the same block (zeros before slot 0)
            shifted = F.pad(blocks[:, :, : S - j], (0, 0, j, 0)).reshape(B, L, D)
            out = out + kernels[:, :, side, j] * shifted
        return out


class DFlash2Layer(DFlashLayer):
    """DFlash's draft layer with a ``BlockConv`` around each sublayer (``attention_conv``, ``mlp_conv``)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, theta: float, block_size: int, kernel_size: int, group_size: int):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, eps, theta)
        self.attention_conv = BlockConv(hidden_size, block_size, kernel_size, group_size)
        self.mlp_conv = BlockConv(hidden_size, block_size, kernel_size, group_size)

    def sublayers(self, h_BSD: Tensor, attend) -> Tensor:
        x = self.input_layernorm(h_BSD)
        k = self.attention_conv.kernels(x)
        h = h_BSD + self.attention_conv(attend(self.attention_conv(x, k, 0)), k, 1)
        y = self.post_attention_layernorm(h)
        k = self.mlp_conv.kernels(y)
        return h + self.mlp_conv(self.mlp(self.mlp_conv(y, k, 0)), k, 1)
