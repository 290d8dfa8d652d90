"""DFlash drafting as one capture-safe step (``inference.static_draft.StaticDraft``): the catch-up on the positions
the target just committed (their context keys, one projection per draft layer) and the whole block in one forward,
over buffers allocated once.

Which token each output predicts: as in ``heads.dflash`` (block slot k >= 1 at position a + k predicts token a + k;
the anchor a is the pending token, the first one the target has not fed yet).

Per draft layer one key / value buffer of Ccap = capacity + max(M, S) columns (column = position; ``length``, a device
scalar, of them valid: a catch-up writes all M committed rows at length + i, the rows past the committed count land
beyond the new length, where they are masked and later overwritten). The block's S keys are written into the same
buffers at columns length .. length + S - 1 (the next catch-up overwrites them) and the block attends to every
column below length + S under one mask: no copy of the context per call. Nothing is read back, nothing the host keeps
is allocated, and no Python value changes between calls.

Shapes: M committed rows, S block size, T = depth drafts, Ccap context columns, g key/value heads, hd head size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.sampling import SamplingConfig
from inference.static_draft import (CommittedBuffers, DraftBuffers, check_layers_held,
                                     check_prompt_fits, draw_chain, mark_static, reseed_draws)


class DFlashStaticDraft:
    """``StaticDraft`` for one ``heads.dflash.DFlashDrafter`` at one capacity bucket (batch 1): a chain of ``depth``
    tokens, greedy or sampled."""

    def __init__(self, drafter, committed: CommittedBuffers, capacity: int, depth: int, sampling: SamplingConfig,
                 generator: torch.Generator | None):
        check_layers_held(drafter, committed)
        M = committed.ids_M.shape[0]
        if not 1 <= depth <= min(M - 1, drafter.block_size - 1):
            raise ValueError(f"{drafter.name}: a draft of depth {depth} needs 1 <= depth <= committed rows - 1 "
                             f"({M - 1}) and <= block_size - 1 ({drafter.block_size - 1})")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 position, got {capacity}")
        self.drafter, self.committed, self.capacity, self.depth = drafter, committed, capacity, depth
        self.sampling, self.generator = sampling, generator
        dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        S = drafter.block_size
        self.ctx_cols = capacity + max(M, S)
        self.keys = [(torch.zeros(1, layer.self_attn.g, self.ctx_cols, layer.self_attn.hd, device=dev, dtype=dtype),
                      torch.zeros(1, layer.self_attn.g, self.ctx_cols, layer.self_attn.hd, device=dev, dtype=dtype))
                     for layer in drafter.layers]
        self.length = torch.zeros((), dtype=torch.long, device=dev)  # context positions cached
        self.fresh = torch.ones((), dtype=torch.bool, device=dev)  # set by prefill: the next draft skips catch-up
        self.anchor = torch.zeros((), dtype=torch.long, device=dev)  # prefill's pending token
        self.cols_C = torch.arange(self.ctx_cols, device=dev)
        self.rows_M = torch.arange(M, device=dev)
        self.slots_S = torch.arange(S, device=dev)
        self.block_ids = torch.full((S,), drafter.mask_token_id, dtype=torch.long, device=dev)
        self.head_rows = drafter.head_rows()  # with a draft vocabulary: its lm_head rows, cut once here
        self.seed = torch.zeros((), dtype=torch.long, device=dev)
        self.counter = torch.zeros((), dtype=torch.long, device=dev)
        self.draws_T = torch.arange(depth, device=dev)
        probs = None if sampling.greedy else torch.zeros(depth, drafter.dims.vocab_size, device=dev)
        self.buffers = DraftBuffers(tokens_T=torch.zeros(depth, dtype=torch.long, device=dev),
                                    parents_T=torch.arange(-1, depth - 1, device=dev), probs_TV=probs, chain=True)
        mark_static(*(t for kv in self.keys for t in kv), self.length, self.fresh, self.anchor, self.cols_C,
                    self.rows_M, self.slots_S, self.block_ids, self.seed, self.counter, self.draws_T,
                    self.buffers.tokens_T, self.buffers.parents_T, *([probs] if probs is not None else []),
                    *([self.head_rows] if self.head_rows is not None else []))

    def _write_context(self, feats_ND: Tensor, pos_N: Tensor) -> None:
        d = self.drafter
        ctx = d._context(feats_ND.to(d.fc.weight.dtype)[None])  # the weights' dtype now (eval may recast them)
        for layer, (kbuf, vbuf) in zip(d.layers, self.keys):
            k, v = layer.self_attn.keys(ctx, pos_N)
            kbuf.index_copy_(2, pos_N, k.to(kbuf.dtype))
            vbuf.index_copy_(2, pos_N, v.to(vbuf.dtype))

    # --- eager, once per sequence -----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt_ids_P: Tensor, hidden_P: dict[int, Tensor], pending: Tensor) -> None:
        d = self.drafter
        P = prompt_ids_P.shape[0]
        check_prompt_fits(d.name, P, self.capacity)
        dev = self.length.device
        feats = torch.cat([hidden_P[i].reshape(P, -1) for i in d.teacher_layers], -1).to(dev)
        self._write_context(feats, torch.arange(P, device=dev))
        self.length.fill_(P)
        self.anchor.copy_(pending.reshape(()).to(dev))
        self.fresh.fill_(True)
        if not self.sampling.greedy:
            reseed_draws(self.seed, self.counter, self.generator)

    # --- capture-safe, every step -----------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self) -> None:
        out, _ = self.block_out()
        logits = self.drafter.draft_logits(out, self.head_rows)  # [T, V]
        if self.sampling.greedy:
            self.buffers.tokens_T.copy_(logits.argmax(-1))
            return
        draw_chain(self, logits)

    def block_out(self) -> tuple[Tensor, Tensor]:
        """The catch-up, then the block: (the drafted slots' normed states [T, D], the anchor token [])."""
        d, c = self.drafter, self.committed
        feats = torch.cat([c.hidden_M[i] for i in d.teacher_layers], -1)
        pos = (self.length + self.rows_M).clamp(max=self.ctx_cols - 1)  # in range whenever length <= capacity
        self._write_context(feats, pos)  # after prefill: written beyond the length, masked, overwritten later
        self.length.add_(torch.where(self.fresh, 0, c.count))
        anchor = torch.where(self.fresh, self.anchor, c.pending)
        self.fresh.fill_(False)
        ids = torch.where(self.slots_S == 0, anchor, self.block_ids)
        block_pos = self.length + self.slots_S  # = the block's columns (length <= capacity: in range)
        cols = block_pos.clamp(max=self.ctx_cols - 1)
        # every slot sees the valid context and the whole block (columns length .. length + S - 1): non-causal
        visible = self.cols_C < self.length + self.slots_S.shape[0]  # [Ccap]
        if d.sliding_window is None:
            mask = visible[None, None, None]  # [1, 1, 1, Ccap]: the same row for every slot
        else:  # each slot sees the context within the window of its own position, and its block
            near = (block_pos[:, None] - self.cols_C[None, :]) < d.sliding_window
            mask = (visible & ((self.cols_C >= self.length) | near))[None, None]  # [1, 1, S, Ccap]
        h = d._embed(ids[None], d.fc.weight)
        for layer, (kbuf, vbuf) in zip(d.layers, self.keys):
            h = layer.forward_in_place(h, block_pos, kbuf, vbuf, cols, mask)
        return d.norm(h[0, 1: self.depth + 1]), anchor
