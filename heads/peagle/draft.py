"""P-EAGLE drafting as one capture-safe step (``inference.static_draft.StaticDraft``): the catch-up on the positions
the target just committed and the depth - 1 parallel slots in ONE layer forward, over buffers allocated once.

Which token each output predicts: as in ``heads.peagle`` (context pair t = the target's features at t and token t+1,
predicting token t+2; slot d at position a + d, a the last context pair, predicts token a + 2 + d).

The buffers are EAGLE's chain step's (``heads.eagle.draft.EagleStaticDraft``, whose constructor, ``prefill`` and
``use_shape`` this reuses), and so is their layout: attention reads the first B columns, a capacity bucket the host
picks before each draft (growing with the sequence); columns [0, B - S) hold the context pairs (column = position,
``length`` of them valid), columns [B - S, B) the S = depth - 1 slots of the current step. Per ``draft()`` the M
committed rows (as pairs at
length + i) and the S slots (placeholders at positions length' - 1 + d, length' the length after this catch-up) are
projected together; a pair attends to the pairs up to itself, a slot to the valid context and the slots up to itself.
Nothing is read back, nothing the host keeps is allocated, and no Python value changes between calls.

Shapes: M committed rows, S = depth - 1 slots, T = depth drafts, B key columns read (the bucket), X = B - S of them
context, Vd draft vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heads.eagle.draft import EagleStaticDraft
from inference.sampling import SamplingConfig
from inference.static_draft import CommittedBuffers, DraftBuffers, draw_chain, mark_static, reseed_draws


class PEagleStaticDraft(EagleStaticDraft):
    """``StaticDraft`` for one ``heads.peagle.PEagleDrafter`` at one capacity bucket (batch 1): a chain of ``depth``
    tokens, greedy or sampled."""

    def __init__(self, drafter, committed: CommittedBuffers, capacity: int, depth: int, sampling: SamplingConfig,
                 generator: torch.Generator | None):
        super().__init__(drafter, committed, capacity, depth)  # a chain: S = depth - 1 slot columns
        dev = self.k.device
        self.sampling, self.generator = sampling, generator
        S = depth - 1
        self.slot_ids = torch.full((S,), drafter.mask_token_id, dtype=torch.long, device=dev)
        self.steps_S = torch.arange(1, S + 1, device=dev)
        self.own_SS = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
        self.no_slots_MS = torch.zeros(committed.ids_M.shape[0], S, dtype=torch.bool, device=dev)
        self.seed = torch.zeros((), dtype=torch.long, device=dev)
        self.counter = torch.zeros((), dtype=torch.long, device=dev)
        self.draws_T = torch.arange(depth, device=dev)
        probs = None if sampling.greedy else torch.zeros(depth, drafter.dims.vocab_size, device=dev)
        self.buffers.parents_T.copy_(torch.arange(-1, depth - 1, device=dev))  # a chain, for every step
        self.buffers = DraftBuffers(tokens_T=self.buffers.tokens_T, parents_T=self.buffers.parents_T, probs_TV=probs,
                                    chain=True)
        self.upper_kv = [(torch.zeros_like(self.k), torch.zeros_like(self.v)) for _ in drafter.upper]  # stacked layers'
        mark_static(*(t for kv in self.upper_kv for t in kv), self.slot_ids, self.steps_S, self.own_SS,
                    self.no_slots_MS, self.seed, self.counter, self.draws_T, *([probs] if probs is not None else []))

    @torch.no_grad()
    def prefill(self, prompt_ids_P, hidden_P, pending) -> None:
        super().prefill(prompt_ids_P, hidden_P, pending)  # EAGLE's layer over the prompt's pairs: its keys, its root
        if len(self.upper_kv):  # the stacked layers over the same pairs, from EAGLE's layer's outputs again
            d = self.drafter
            P = prompt_ids_P.shape[0]
            dev, dtype = self.k.device, self.k.dtype
            feats = torch.cat([hidden_P[i].reshape(P, -1) for i in d.teacher_layers], -1).to(dev, dtype)
            nxt = torch.cat([prompt_ids_P[1:].to(dev), pending.reshape(1).to(dev)])
            hid = d._first_hidden(feats[None])
            x, residual = d._layer_input(d._embed(nxt[None], hid), hid)
            cos, sin = self.cos[:P], self.sin[:P]
            mask = self.context_mask(torch.arange(P, device=dev), P)
            q, k, v = d.layer.qkv_rotated(x, cos, sin)
            out = d.layer.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), residual)
            for upper, (kbuf, vbuf) in zip(d.upper, self.upper_kv):
                q, k, v = upper.qkv_rotated(out, cos, sin)
                kbuf[:, :, :P] = k
                vbuf[:, :, :P] = v
                out = upper.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), out)
            self.node_out[0] = d._output(out)[0, P - 1]
        if not self.sampling.greedy:
            reseed_draws(self.seed, self.counter, self.generator)

    @torch.no_grad()
    def draft(self) -> None:
        d, c = self.drafter, self.committed
        M, S = self.rows_M.shape[0], self.steps_S.shape[0]
        dtype = self.k.dtype
        feats = torch.cat([c.hidden_M[i] for i in d.teacher_layers], -1).to(dtype)
        nxt = torch.where(self.rows_M + 1 < c.count, c.ids_M.roll(-1), c.pending)
        pos = (self.length + self.rows_M).clamp(max=self.ctx_cols - 1)  # in range whenever length <= capacity
        length = self.length + torch.where(self.fresh, 0, c.count)  # after prefill the catch-up is discarded
        slot_pos = length - 1 + self.steps_S
        hid = d._first_hidden(feats[None])
        hid_m = d._first_hidden(d.mask_hidden.to(dtype)).expand(1, S, -1)
        emb = d._embed(torch.cat([nxt, self.slot_ids])[None], hid)
        x, residual = d._layer_input(emb, torch.cat([hid, hid_m], 1))
        all_pos = torch.cat([pos, slot_pos])
        cos, sin = self.cos[all_pos], self.sin[all_pos]
        ctx = self.cols_C[: self.bucket - S]  # the bucket's context columns; its slot columns follow
        pairs = torch.cat([self.context_mask(pos, ctx.shape[0]), self.no_slots_MS], 1)  # [M, B]: pairs up to itself
        seen = (ctx < length)[None].expand(S, -1)
        window = d.window_mask(slot_pos[:, None], ctx[None, :])  # within the window of the slot's position
        seen = seen if window is None else seen & window
        slots = torch.cat([seen, self.own_SS], 1)  # [S, B]: context, slots <= itself
        mask = torch.cat([pairs, slots])[None, None]
        out = self._attend(d.layer, x, residual, cos, sin, pos, self.k, self.v, mask)
        for upper, (kbuf, vbuf) in zip(d.upper, self.upper_kv):
            out = self._attend(upper, out, out, cos, sin, pos, kbuf, vbuf, mask)
        out = d._output(out)[0]
        root = torch.where(self.fresh, self.node_out[0], out.index_select(0, (c.count - 1).reshape(1))[0])
        self.node_out[0].copy_(root)
        self.length.copy_(length)
        self.fresh.fill_(False)
        logits = d._logits(torch.cat([root[None], out[M:]]))  # [T, Vd]
        if self.sampling.greedy:
            self.buffers.tokens_T.copy_(d.d2t[logits.argmax(-1)])
            return
        full = logits.new_full((logits.shape[0], d.dims.vocab_size), float("-inf")).index_copy(1, d.d2t, logits)
        draw_chain(self, full)

    def _attend(self, layer, x, residual, cos, sin, pos, kbuf, vbuf, mask):
        """One layer over the M committed rows and the S slots: their keys written into ``kbuf`` / ``vbuf`` (rows
        at their positions, slots in the bucket's last S columns), attention over the bucket's B columns under
        ``mask``. A real row's position lies below the new length, inside the context columns; a padding row that
        lands in a slot column is overwritten by the slots before attention reads it."""
        M, S, B = pos.shape[0], self.steps_S.shape[0], self.bucket
        q, k, v = layer.qkv_rotated(x, cos, sin)
        kbuf.index_copy_(2, pos, k[:, :, :M])
        vbuf.index_copy_(2, pos, v[:, :, :M])
        kbuf[:, :, B - S:B].copy_(k[:, :, M:])
        vbuf[:, :, B - S:B].copy_(v[:, :, M:])
        attended = F.scaled_dot_product_attention(q, kbuf[:, :, :B], vbuf[:, :, :B], attn_mask=mask)
        return layer.finish(attended, residual)
