"""Which keys each verified token may see, per attention layer type of the target: the one place sliding windows are
handled, for the batch-1 and the batched decoder alike.

A verification forward passes its own 4D mask (tree ancestry, each row's committed length). Hugging Face uses a 4D
mask *as given* for every layer, so a target with sliding-window layers would let those layers see past their
window. Instead the mask is built per layer type: a key is visible to a query in a ``sliding_attention`` layer only
when ``pos(query) - pos(key) < window`` (transformers' ``sliding_window_overlay``: ``kv > q - window``), and targets
whose layers mix types get ``{layer type: mask}``, which their forward indexes by ``config.layer_types`` (Gemma-2/3,
Qwen2/3). The KV cache keeps every layer whole (no rolling window): rejected drafts, tree
compaction and each row's own length then work the same on every layer, and the mask alone decides visibility. The cost is
memory: sliding layers keep the whole context instead of the last ``window`` tokens.

Shapes: B rows, N new tokens, K key columns (cached + new).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import get_layer_types_and_kwargs

FULL, SLIDING = "full_attention", "sliding_attention"
SUPPORTED_LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class AttentionLayout:
    """The target's attention layer types (from its config, as transformers' own cache reads them)."""

    layer_types: tuple[str, ...]
    window: int | None  # the sliding layers' window (None: no sliding layer)

    @classmethod
    def of(cls, model) -> "AttentionLayout":
        """From a model or its config."""
        config = getattr(model, "config", model).get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(config)
        unknown = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"the target ({config.model_type}) has attention layers of type {unknown}; speculative verification "
                f"supports {list(SUPPORTED_LAYER_TYPES)} (its masks are built per layer type, inference/masks.py)")
        windows = {kw["sliding_window"] for t, kw in zip(types, kwargs) if t == SLIDING}
        if len(windows) > 1:
            raise ValueError(f"the target's sliding layers use different windows {sorted(windows)}; one is supported")
        return cls(tuple(types), windows.pop() if windows else None)

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def additive(self, allowed_BNK: Tensor, q_pos_BN: Tensor, k_pos_BK: Tensor,
                 dtype: torch.dtype) -> Tensor | dict[str, Tensor]:
        """The forward's ``attention_mask``: [B, 1, N, K] additive (0 visible, dtype min hidden) from ``allowed``
        (what full attention may see), narrowed to the window for sliding layers; a dict when types mix."""
        masks = {FULL: allowed_BNK}
        if self.sliding:
            near = (q_pos_BN[:, :, None] - k_pos_BK[:, None, :]) < self.window
            masks[SLIDING] = allowed_BNK & near
        out = {t: _additive(m, dtype) for t, m in masks.items() if t in self.layer_types}
        return out[self.layer_types[0]] if len(out) == 1 else out


def _additive(allowed_BNK: Tensor, dtype: torch.dtype) -> Tensor:
    mask = torch.zeros(allowed_BNK.shape, dtype=dtype, device=allowed_BNK.device)
    return mask.masked_fill_(~allowed_BNK, torch.finfo(dtype).min)[:, None]
