"""EAGLE-1 / EAGLE-3 drafting as one capture-safe step (``inference.static_draft.StaticDraft``): the catch-up on the
positions the target just committed and every tree level, over buffers allocated once.

Which token each output predicts: as in ``heads.eagle`` (context pair t = the target's feature at t and token t + 1,
whose output predicts token t + 2; a depth-d node predicts the token d + 1 past the pending one).

One buffer of C = capacity + M + S columns holds every key the drafter's attention reads; attention reads its first
B columns, a capacity bucket (``inference.batch_cache.capacity_buckets`` of C; a Python constant per recorded step):

    columns [0, B - S)        context pairs, column = position; ``length`` (a device scalar) of them are valid. A
                              catch-up writes all M rows at length + i, and the rows past the committed count land
                              beyond the new length, where they are masked and later overwritten.
    columns [B - S, B)        draft nodes, in the slots ``inference.dynamic_tree`` numbers them by (level d's
                              frontier in slots (d - 1) F .. d F - 1); a node sees the valid context and its own
                              ancestors (``ancestry``), never another step's stale slots.

The decoder picks B on the host before each draft (``use_shape``, as the draft model's static step does): the
smallest bucket whose context part holds the context after the catch-up, so the key length grows with the sequence
(256, 512, ..., C) instead of being C at every level. Nodes are only ever written at or past the context's end, so a
context column, once written by a catch-up, stays valid whatever bucket later steps use. Without ``use_shape`` B = C
(the slots right behind the capacity + M context columns).

Per ``draft()``: catch-up (M rows, padding masked) -> root output -> ``expand_dynamic_trees`` (fixed shapes for fixed
(top_k, depth, total_tokens); the chain is top_k 1) scoring each level into its slots -> ``DraftBuffers``. Rotary
tables are made once for every position and indexed by device positions; nothing is read back, nothing the host keeps
is allocated, and no Python value changes between calls of one bucket, so one recording per bucket serves every step
of every sequence that fits the capacity.

Shapes: M committed rows, S node slots (F per level below the first), F frontier nodes per level (min(top_k, Vd)),
T draft nodes, C buffer columns, B of them read (the bucket), h heads, hd head size, D hidden size, Vd draft vocabulary.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.dynamic_tree import expand_dynamic_trees
from inference.batch_cache import capacity_buckets
from inference.static_draft import (CommittedBuffers, DraftBuffers, check_layers_held,
                                     check_prompt_fits, mark_static)


def tree_sizes(top_k: int, depth: int, total_tokens: int, vocab: int) -> tuple[int, int, int]:
    """(F frontier nodes per level, S node slots, T draft nodes) of ``expand_dynamic_trees`` for these settings."""
    frontier = min(top_k, vocab)
    scored = frontier + (depth - 1) * frontier * frontier
    return frontier, (depth - 1) * frontier, min(total_tokens, scored)


class EagleStaticDraft:
    """``StaticDraft`` for one ``heads.eagle.EagleDrafter`` at one capacity bucket (batch 1)."""

    def __init__(self, drafter, committed: CommittedBuffers, capacity: int, depth: int):
        check_layers_held(drafter, committed)
        M = committed.ids_M.shape[0]
        if not 1 <= depth <= M - 1:
            raise ValueError(f"{drafter.name}: a draft of depth {depth} needs committed buffers of at least 1 + depth "
                             f"rows (the verify bucket's deepest path), got {M}: allocate them with rows >= "
                             f"{max(depth, 1) + 1}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 position, got {capacity}")
        self.drafter, self.committed, self.capacity, self.depth = drafter, committed, capacity, depth
        layer = drafter.layer
        dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.chain = drafter.tree_mode == "chain"
        self.top_k = 1 if self.chain else drafter.top_k
        self.total = depth if self.chain else drafter.total_tokens
        self.frontier, S, T = tree_sizes(self.top_k, depth, self.total, drafter.draft_vocab_size)
        self.ctx_cols = capacity + M  # the context columns of the largest bucket (C)
        C = self.ctx_cols + S
        self.buckets = capacity_buckets(C)
        self.bucket = C  # key columns attention reads (``use_shape``)
        self.k = torch.zeros(1, layer.num_heads, C, layer.head_dim, device=dev, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = torch.zeros((), dtype=torch.long, device=dev)  # context pairs processed
        self.fresh = torch.ones((), dtype=torch.bool, device=dev)  # set by prefill: the next draft skips catch-up
        self.node_out = torch.zeros(1 + S, drafter.dims.hidden_size, device=dev, dtype=dtype)  # root, then slots
        # Row 1 + s: slot s's ancestors and itself (1); row 0 (the root's children's parent) stays empty. Small
        # integers, not bool: inductor's CPU code generation fails on bool rows OR-ed through an index.
        self.ancestry = torch.zeros(1 + S, S, dtype=torch.uint8, device=dev)
        self.eye_SS = torch.eye(S, dtype=torch.uint8, device=dev)
        self.cos, self.sin = layer.rope_tables(torch.arange(C + depth, device=dev), dtype)  # [positions, hd]
        self.cols_C = torch.arange(C, device=dev)
        self.rows_M = torch.arange(M, device=dev)
        self.buffers = DraftBuffers(tokens_T=torch.zeros(T, dtype=torch.long, device=dev),
                                    parents_T=torch.full((T,), -1, dtype=torch.long, device=dev), chain=self.chain)
        mark_static(self.k, self.v, self.length, self.fresh, self.node_out, self.ancestry, self.eye_SS, self.cos,
                    self.sin, self.cols_C, self.rows_M, self.buffers.tokens_T, self.buffers.parents_T)

    # --- eager, once per sequence -----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt_ids_P: Tensor, hidden_P: dict[int, Tensor], pending: Tensor) -> None:
        d = self.drafter
        P = prompt_ids_P.shape[0]
        check_prompt_fits(d.name, P, self.capacity)
        dev, dtype = self.k.device, self.k.dtype
        feats = torch.cat([hidden_P[i].reshape(P, -1) for i in d.teacher_layers], -1).to(dev, dtype)
        nxt = torch.cat([prompt_ids_P[1:].to(dev), pending.reshape(1).to(dev)])  # token t + 1 of pair t
        hid = d._first_hidden(feats[None])
        x, residual = d._layer_input(d._embed(nxt[None], hid), hid)
        q, k, v = d.layer.qkv_rotated(x, self.cos[:P], self.sin[:P])
        self.k[:, :, :P] = k
        self.v[:, :, :P] = v
        mask = self.context_mask(torch.arange(P, device=dev), P)
        out = d._finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), residual)[0]
        self.node_out[0] = out[P - 1]
        self.length.fill_(P)
        self.fresh.fill_(True)

    def use_shape(self, context: int, own_draft: bool) -> tuple[int]:
        """Host, before a ``draft`` after ``context`` committed tokens (the pending token's position: the context
        pairs once the catch-up has run, whose real rows all sit below it): attention over the smallest capacity
        bucket holding those pairs and the S node slots behind them. Returns (bucket,): the recorded step's key.
        ``own_draft`` changes nothing here (the catch-up always runs all M rows)."""
        S = self.ancestry.shape[1]
        if context + S > self.buckets[-1]:
            raise ValueError(f"{self.drafter.name}: a draft after {context} tokens does not fit this static draft's "
                             f"capacity {self.capacity}; allocate it with a capacity >= {context}")
        self.bucket = next(b for b in self.buckets if b >= context + S)
        return (self.bucket,)

    # --- capture-safe, every step -----------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self) -> None:
        self._catch_up()
        ctx = self.bucket - self.ancestry.shape[1]  # the bucket's context columns; its node slots follow
        ctx_mask = (self.cols_C[:ctx] < self.length)[None].expand(self.frontier, ctx)
        d = self.drafter
        tokens, parents = expand_dynamic_trees(functools.partial(self._score, ctx_mask), self.top_k, self.depth,
                                               self.total)
        self.buffers.tokens_T.copy_(d.d2t[tokens[0]])
        self.buffers.parents_T.copy_(parents[0])

    def _catch_up(self) -> None:
        """Run the committed rows as context pairs at positions length + i (pair i: the target's feature after
        ids_M[i] and the token after it, ids_M[i + 1] or the pending token); advance ``length`` by ``count`` and
        take row count - 1's output as the root. After ``prefill`` the same work runs and is discarded."""
        d, c = self.drafter, self.committed
        feats = torch.cat([c.hidden_M[i] for i in d.teacher_layers], -1).to(self.k.dtype)
        nxt = torch.where(self.rows_M + 1 < c.count, c.ids_M.roll(-1), c.pending)
        pos = (self.length + self.rows_M).clamp(max=self.ctx_cols - 1)  # in range whenever length <= capacity
        hid = d._first_hidden(feats[None])
        x, residual = d._layer_input(d._embed(nxt[None], hid), hid)
        q, k, v = d.layer.qkv_rotated(x, self.cos[pos], self.sin[pos])
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        B = self.bucket  # a real row's pairs lie below the new length, inside the bucket's context columns
        mask = self.context_mask(pos, B)  # [M, B]: its own and earlier pairs (never a node slot)
        out = d._finish(F.scaled_dot_product_attention(q, self.k[:, :, :B], self.v[:, :, :B],
                                                       attn_mask=mask[None, None]), residual)[0]
        last = out.index_select(0, (c.count - 1).reshape(1))[0]
        self.node_out[0].copy_(torch.where(self.fresh, self.node_out[0], last))
        self.length.add_(torch.where(self.fresh, 0, c.count))
        self.fresh.fill_(False)

    def context_mask(self, pos: Tensor, columns: int) -> Tensor:
        """[len(pos), columns] bool: the context pairs a query at each of ``pos`` sees: those at or before it (within
        the drafter's sliding window)."""
        cols = self.cols_C[:columns]
        mask = cols[None, :] <= pos[:, None]
        window = self.drafter.window_mask(pos[:, None], cols[None, :])
        return mask if window is None else mask & window

    def _score(self, ctx_mask_FX: Tensor, level: int, parent_slot_BF: Tensor | None, tokens_BF: Tensor | None
               ) -> Tensor:
        """``expand_dynamic_trees``' level scorer: level 0 the root, level d its F frontier nodes written into their
        slots (the bucket's last S columns) and run over the valid context (``ctx_mask_FX``, X = B - S: the bucket's
        context columns) and their ancestors; logits [1, (F,) Vd]."""
        d = self.drafter
        if level == 0:
            return d._logits(self.node_out[:1])
        Fn = self.frontier
        lo, hi = (level - 1) * Fn, level * Fn  # this level's slots (Python constants per level)
        parent = parent_slot_BF[0] + 1  # row of node_out / of ancestry (0: the root)
        parent_out = self.node_out.index_select(0, parent)
        x, residual = d._layer_input(d._embed(d.d2t[tokens_BF[0]][None], parent_out), parent_out[None])
        pos = (self.length - 1 + level).reshape(1)
        q, k, v = d.layer.qkv_rotated(x, self.cos[pos], self.sin[pos])
        X = ctx_mask_FX.shape[1]  # the bucket's node slots start here (Python constants per bucket)
        window = d.window_mask(pos, self.cols_C[:X])
        ctx_mask_FX = ctx_mask_FX if window is None else ctx_mask_FX & window
        self.k[:, :, X + lo: X + hi].copy_(k)
        self.v[:, :, X + lo: X + hi].copy_(v)
        rows = self.ancestry.index_select(0, parent) + self.eye_SS[lo:hi]  # [F, S]: the parent's, and itself
        self.ancestry[1 + lo: 1 + hi].copy_(rows)
        mask = torch.cat([ctx_mask_FX, rows.bool()], 1)  # [F, B]: the valid context, its ancestors and itself
        B = self.bucket
        out = d._finish(F.scaled_dot_product_attention(q, self.k[:, :, :B], self.v[:, :, :B],
                                                       attn_mask=mask[None, None]), residual)[0]
        self.node_out[1 + lo: 1 + hi].copy_(out)
        return d._logits(out)[None]
