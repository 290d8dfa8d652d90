"""DFlash drafting for a batch of sequences (``inference.proposer.ProposerRows``): every row's block in one drafter
forward, where ``heads.base.ForkedRows`` would run one forward per row.

Which token each output predicts: as in ``heads.dflash`` (block slot k >= 1 at position a + k predicts token a + k;
the anchor a is each row's last committed token, whose target features are not known yet).

Per row: the observed target features not yet turned into context keys, and a ragged context cache per draft layer
([B, g, capacity, hd], row b's first ``lengths[b]`` columns valid). A proposal catches every row up (its new
positions, padded to the longest, in one projection per layer), then runs the B blocks [anchor, MASK ...] at
positions a_b .. a_b + S - 1 together; row b's queries see its own valid context (within the sliding window, when
set) and its whole block.

Shapes: B rows, M new context positions (padded), S block size, C context columns, g key/value heads, hd head size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.base import row_chains
from inference.sampling import SamplingConfig, seeded_generator
from inference.tree import DraftTree


class DFlashRows:
    """``ProposerRows`` for one ``heads.dflash.DFlashDrafter``: B sequences, drafted in one forward per step."""

    def __init__(self, drafter, seeds: list[int]):
        self.drafter = drafter
        self.pending: list[list[Tensor]] = [[] for _ in seeds]  # per row: [m, F*D] features not yet cached
        self.lengths = [0] * len(seeds)  # context positions cached per row (host: shapes only)
        self.keys: list[tuple[Tensor, Tensor]] | None = None  # per layer: [B, g, capacity, hd] keys / values
        self.generators: list[torch.Generator | None] = [None] * len(seeds)
        self.seeds = list(seeds)

    def __len__(self) -> int:
        return len(self.lengths)

    def observe(self, row: int, hidden: dict[int, Tensor]) -> None:
        if hidden:
            self.pending[row].append(torch.cat([hidden[i][0] for i in self.drafter.teacher_layers], -1))

    def accepted(self, row: int, path: list[int], committed: list[int] | None = None) -> None:
        """Nothing to do: the next block's context is the cached one + the newly observed positions."""

    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` (in this order) stay in the batch."""
        self.pending = [self.pending[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        self.generators = [self.generators[r] for r in rows]
        self.seeds = [self.seeds[r] for r in rows]
        if self.keys is not None:
            index = torch.tensor(rows, dtype=torch.long, device=self.keys[0][0].device)
            self.keys = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.keys]

    @torch.no_grad()
    def propose(self, tokens: list[Tensor], depths: list[int], samplings: list[SamplingConfig]) -> list[DraftTree]:
        """Row b's chain continuing ``tokens[b]`` ([1, n_b]), at most ``depths[b]`` deep (0: an empty tree)."""
        out, _ = self.block_out(tokens)
        B, top = out.shape[:2]
        logits = self.drafter.draft_logits(out.reshape(B * top, -1)).view(B, top, -1)
        return row_chains(logits, tokens, [min(top, want) for want in depths], samplings, self._sampler)

    def block_out(self, tokens: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Every row caught up, then the B blocks in one forward: (the drafted slots' normed states [B, top, D], the
        anchors [B])."""
        d = self.drafter
        self._catch_up(tokens)
        dev = d.fc.weight.device
        S, B = d.block_size, len(tokens)
        anchors = torch.stack([t[0, -1] for t in tokens]).to(dev)
        ids = torch.full((B, S), d.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        lengths = torch.tensor(self.lengths, device=dev)  # = each row's anchor position
        slots = torch.arange(S, device=dev)
        pos = lengths[:, None] + slots  # [B, S]
        C = max(self.lengths)
        cols = torch.arange(C, device=dev)
        sees = (cols[None, None, :] < lengths[:, None, None]).expand(B, S, C)  # [B, S, C]: its own context
        if d.sliding_window is not None:
            sees = sees & ((pos[:, :, None] - cols) < d.sliding_window)
        mask = torch.cat([sees, torch.ones(B, S, S, dtype=torch.bool, device=dev)], -1)[:, None]
        h = d._embed(ids, d.fc.weight)
        for layer, (k, v) in zip(d.layers, self.keys):
            h = layer(h, pos, k[:, :, :C].to(h.dtype), v[:, :, :C].to(h.dtype), mask)
        top = min(d.depth or S - 1, S - 1)
        return d.norm(h[:, 1: top + 1]), anchors  # [B, top, D]

    def _sampler(self, row: int, device: torch.device) -> torch.Generator:
        self.generators[row] = seeded_generator(self.generators[row], self.seeds[row], device)
        return self.generators[row]

    def _catch_up(self, tokens: list[Tensor]) -> None:
        """Cache every row's context keys up to its anchor (positions 0 .. n_b - 2), padded to the longest."""
        d = self.drafter
        dev, dtype = d.fc.weight.device, d.fc.weight.dtype
        new = [t.shape[1] - 1 - n for t, n in zip(tokens, self.lengths)]
        for b, m in enumerate(new):
            seen = sum(f.shape[0] for f in self.pending[b])
            if seen < m:
                raise RuntimeError(f"{d.name}: row {b} proposes after {tokens[b].shape[1]} tokens, which needs target "
                                   f"features for {m} new positions; observed {seen}. The decoder must observe() the "
                                   f"prefill and every committed position")
        self._reserve(max(n + m for n, m in zip(self.lengths, new)) + d.block_size, dev, dtype)
        M = max(new)
        if M == 0:
            return
        B = len(tokens)
        feats = torch.zeros(B, M, d.fc.in_features, device=dev, dtype=dtype)
        for b, m in enumerate(new):
            if m:
                rows = torch.cat(self.pending[b])
                feats[b, :m] = rows[:m].to(dev, dtype)
                self.pending[b] = [rows[m:]] if rows.shape[0] > m else []
        start = torch.tensor(self.lengths, device=dev)
        pos = start[:, None] + torch.arange(M, device=dev)  # [B, M]; padding rows land past the row's length
        ctx = d._context(feats)
        for layer, (kc, vc) in zip(d.layers, self.keys):
            k, v = layer.self_attn.keys(ctx, pos)
            for b, (n, m) in enumerate(zip(self.lengths, new)):
                kc[b, :, n: n + m] = k[b, :, :m].to(kc.dtype)
                vc[b, :, n: n + m] = v[b, :, :m].to(vc.dtype)
        self.lengths = [n + m for n, m in zip(self.lengths, new)]

    def _reserve(self, columns: int, dev: torch.device, dtype: torch.dtype) -> None:
        """Room for ``columns`` context columns per row, grown geometrically (amortised O(1) per token)."""
        have = 0 if self.keys is None else self.keys[0][0].shape[2]
        if columns <= have:
            return
        size, B = max(2 * columns, 64), len(self.lengths)
        grown = []
        for i, layer in enumerate(self.drafter.layers):
            attn = layer.self_attn
            k = torch.zeros(B, attn.g, size, attn.hd, device=dev, dtype=dtype)
            v = torch.zeros_like(k)
            if have:
                k[:, :, :have], v[:, :, :have] = self.keys[i]
            grown.append((k, v))
        self.keys = grown
