"""The draft model's batch cache (``heads.draft_model.rows``): a preallocated KV cache any Hugging Face causal LM
fills through its own forward, whose rows may differ in length.

Each layer keeps one buffer per keys / values of ``capacity`` columns ([B, heads, capacity, head_dim]) and a length
pointer. ``update`` writes the new entries in place behind the pointer (or, in ragged mode, at each row's own columns)
and returns views of the first ``length`` columns (attention reads strided views without copying), so a step does
not concatenate the whole cache anew per layer, as ``DynamicCache`` does. A rejected tail is dropped by moving the
pointer (``crop(-n)``); ``batch_select_indices`` drops finished rows.

To the model the layer looks like a ``DynamicLayer`` (mask sizes = cached + new tokens, no maximum it enforces): the
causal and 4D masks, position ids and sliding windows work as with the default cache. A buffer that fills up grows
to twice its size (one copy, amortised). The target's caches are ``inference.static_cache`` (batch 1) and
``inference.batch_cache`` (batch buckets).

Shapes: B rows, h KV heads, C capacity, L length (cached columns), n new columns, hd head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

MIN_CAPACITY = 64


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's keys and values in preallocated buffers with a length pointer."""

    is_compileable = False  # lengths change per step: HF's static-cache paths (full-buffer masks) must not apply
    is_sliding = False  # sliding layers are kept whole too; their window is in the masks (inference.masks)
    is_croppable = True

    def __init__(self, capacity: int = MIN_CAPACITY):
        super().__init__()
        if capacity < 1:
            raise ValueError(f"PreallocatedLayer capacity={capacity} must be >= 1 (columns to preallocate)")
        self.capacity = int(capacity)
        self.length = 0
        self._k: Tensor | None = None  # [B, h, C, hd]
        self._v: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._k = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:2], self.capacity, value_states.shape[-1]))
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        self.capacity = max(needed, 2 * self.capacity)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            grown = old.new_empty((*old.shape[:2], self.capacity, old.shape[-1]))
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(self.length + n)
        self._k[:, :, self.length: self.length + n] = key_states
        self._v[:, :, self.length: self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # as DynamicLayer: the cached columns plus the new ones, from column 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows when full: no maximum the model has to respect

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._views()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give the number of columns to remove as a negative count")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._views()

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._views()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))


class RaggedLayer(PreallocatedLayer):
    """A ``PreallocatedLayer`` whose rows may differ in length: between forwards its owner (``RaggedCache``) may
    direct each new entry to a column of its own row (``RaggedCache.write_at``) instead of appending behind the shared
    pointer. Buffers start zeroed: a row's columns past its own length but below the longest row's are masked, and a
    masked column must still hold a finite number (attention weighs it by 0, and 0 * NaN is NaN)."""

    def __init__(self, capacity: int, owner: "RaggedCache"):
        super().__init__(capacity)
        self._owner = owner

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k.zero_()
        self._v.zero_()

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        super()._reserve(needed)  # copies the first ``length`` columns into fresh (uninitialised) buffers
        self._k[:, :, self.length:].zero_()
        self._v[:, :, self.length:].zero_()

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        cols_BN, extent = self._owner.columns, self._owner.extent
        if cols_BN is None:
            return super().update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._reserve(extent + 1)  # + the scratch column padding entries go to
        B, h, n, hd = key_states.shape
        index = cols_BN[:, None, :, None].expand(B, h, n, hd)
        self._k.scatter_(2, index, key_states)
        self._v.scatter_(2, index, value_states)
        self.length = extent
        self._views()
        return self.keys, self.values


class RaggedCache(Cache):
    """Rows of different lengths, each dense from column 0 (row b's entries in columns 0 .. len_b - 1), in
    ``RaggedLayer``s (one per attention layer, created as the forward reaches them, like ``DynamicCache``), each
    preallocating ``capacity`` columns; a draft model's batch (``heads.draft_model.rows``) keeps one.

    By default a forward appends behind the shared pointer (all rows equally long: batch 1). ``write_at(cols_BN,
    extent)`` makes the next forwards write row b's n new entries to columns ``cols_BN[b]`` instead (a scatter; the
    owner passes ``extent`` = the longest row's length after the write, and gives padding entries the column
    ``extent``, which no one reads: it is past every row and overwritten before a row grows into it); the layers then
    return every row's first ``extent`` columns, and the forward's 4D mask shows each query its own row's columns.
    Rolling a row back is its owner's business (it forgets the row's length); nothing is copied."""

    def __init__(self, capacity: int = MIN_CAPACITY):
        if capacity < 1:
            raise ValueError(f"RaggedCache capacity={capacity} must be >= 1 (columns to preallocate)")
        self.capacity = int(capacity)
        super().__init__(layer_class_to_replicate=self._new_layer)
        self.columns: Tensor | None = None  # [B, n] long: where the next forward's entries go (None: append)
        self.extent = 0

    def _new_layer(self) -> RaggedLayer:
        return RaggedLayer(self.capacity, self)

    def write_at(self, cols_BN: Tensor | None, extent: int = 0) -> None:
        self.columns, self.extent = cols_BN, extent

    def set_length(self, length: int) -> None:
        """Append mode: every row is ``length`` long (no longer than the shortest row's real entries)."""
        for layer in self.layers:
            layer.length = length
            if layer.is_initialized:
                layer._views()
