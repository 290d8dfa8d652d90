"""P-EAGLE drafting for a batch of sequences (``inference.proposer.ProposerRows``): every row's chain in one drafter
forward, where ``heads.base.ForkedRows`` would run one forward per row.

Which token each output predicts: as in ``heads.peagle`` (the last context pair's output predicts the first draft;
parallel slot d at position L - 1 + d predicts draft d + 1, L the row's context pairs).

Per row and per draft layer (EAGLE-3's, then the stacked ones) a ragged context cache: EAGLE's
(``heads.eagle.rows.EagleRows``, row b's first ``lengths[b]`` columns of a [B, h, capacity, hd] buffer). A proposal
runs every row's new context pairs (padded to the longest) and its S parallel slots through the layers together;
pair queries see their row's pairs up to themselves, slot d its row's pairs and slots 1..d. The pairs' keys are
appended to the caches; the slots' are not (they change every step).

Shapes: B rows, M new context pairs (padded), S parallel slots, C context columns, h heads, hd head size, D hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from heads.base import row_chains
from heads.eagle.rows import EagleRows
from inference.sampling import SamplingConfig, seeded_generator
from inference.tree import DraftTree


class PEagleRows(EagleRows):
    """``ProposerRows`` for one ``heads.peagle.PEagleDrafter``: B sequences, every chain in one forward per step."""

    def __init__(self, drafter, seeds: list[int]):
        super().__init__(drafter, len(seeds))
        self.upper: list[tuple[Tensor, Tensor]] = []  # per stacked layer: [B, h, capacity, hd] keys / values
        self.seeds = list(seeds)
        self.generators: list[torch.Generator | None] = [None] * len(seeds)

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        self.seeds = [self.seeds[r] for r in rows]
        self.generators = [self.generators[r] for r in rows]
        if self.upper:
            index = torch.tensor(rows, dtype=torch.long, device=self.k.device)
            self.upper = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.upper]

    @torch.no_grad()
    def propose(self, tokens: list[Tensor], depths: list[int], samplings: list[SamplingConfig]) -> list[DraftTree]:
        """Row b's chain continuing ``tokens[b]`` ([1, n_b]): min(drafter.depth or num_depths, depths[b]) drafts
        (0: an empty tree), as ``PEagleDrafter.propose`` drafts per row."""
        d = self.drafter
        wants = [min(d.depth or d.num_depths, n, d.num_depths) for n in depths]
        if max(wants) < 1:
            return [DraftTree.empty(t.device) for t in tokens]
        out = self._forward(tokens, max(wants) - 1)  # [B, depth, D]
        logits = d.target_logits(d._logits(out))  # [B, depth, V]
        return row_chains(logits, tokens, wants, samplings, self._sampler)

    def _sampler(self, row: int, device: torch.device) -> torch.Generator:
        # seeded as a per-row fork's (``PEagleDrafter._sampler``)
        self.generators[row] = seeded_generator(self.generators[row], self.seeds[row], device)
        return self.generators[row]

    def _forward(self, tokens: list[Tensor], S: int) -> Tensor:
        """[B, 1 + S, D]: every row's root (its last context pair's output) and its S slots' outputs, the new pairs
        and the slots in one pass through the layers; the pairs' keys join the rows' caches."""
        d = self.drafter
        dev, dtype = d.fc.weight.device, d.fc.weight.dtype
        feats, ids, new = self._new_pairs(tokens, dev, dtype)
        B, M = ids.shape
        old = torch.tensor(self.lengths, device=dev)
        total = old + torch.tensor(new, device=dev)  # [B]: context pairs after this call
        self._reserve(max(n + m for n, m in zip(self.lengths, new)), dev)
        hid = [d._first_hidden(feats)] if M else []
        emb = [d._embed(ids, hid[0])] if M else []
        hid.append(d._first_hidden(d.mask_hidden.to(dtype)).expand(B, S, -1))
        emb.append(d._embed(torch.full((B, S), d.mask_token_id, dtype=torch.long, device=dev), hid[-1]))
        x, residual = d._layer_input(torch.cat(emb, 1), torch.cat(hid, 1))
        slot = torch.arange(1, S + 1, device=dev)
        pos = torch.cat([old[:, None] + torch.arange(M, device=dev), total[:, None] - 1 + slot], 1)  # [B, M + S]
        C = max(n + m for n, m in zip(self.lengths, new))
        # context columns a query sees: a pair those <= its position (a padding pair's output is never used), a slot
        # its row's pairs; among the slots, slot d sees slots 1..d
        sees = torch.cat([pos[:, :M], (total[:, None] - 1).expand(B, S)], 1)
        cols = torch.arange(C, device=dev)[None, None, :]
        ctx = cols <= sees[:, :, None]  # [B, M + S, C]
        window = d.window_mask(pos[:, :, None], cols)  # within the window of the query's own position
        ctx = ctx if window is None else ctx & window
        among = torch.zeros(M + S, S, dtype=torch.bool, device=dev)
        among[M:] = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([ctx, among.expand(B, -1, -1)], 2)[:, None]
        q, k, v = d.layer.qkv(x, pos)
        out = d.layer.finish(self._attend(q, k, v, (self.k, self.v), new, C, mask), residual)
        for upper, cache in zip(d.upper, self.upper):
            uq, uk, uv = upper.qkv(out, pos)
            out = upper.finish(self._attend(uq, uk, uv, cache, new, C, mask), out)
        out = d._output(out)
        self.valid[:, :C] = torch.arange(C, device=dev)[None, :] < total[:, None]
        if M:
            last = torch.stack([out[b, max(m - 1, 0)] for b, m in enumerate(new)])
            if self.root is not None and min(new) == 0:
                last = torch.where(torch.tensor([m > 0 for m in new], device=dev)[:, None], last, self.root)
            self.root = last
        self.lengths = [n + m for n, m in zip(self.lengths, new)]
        return torch.cat([self.root[:, None], out[:, M:]], 1)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cache: tuple[Tensor, Tensor], new: list[int], C: int,
                mask: Tensor) -> Tensor:
        """Append the new pairs' keys (the first ``new[b]`` of row b's M) to a layer's cache; attend over the
        cache's first C columns and the slots' keys (the last S of the M + S)."""
        k_cache, v_cache = cache
        M = max(new)
        for b, (n, m) in enumerate(zip(self.lengths, new)):
            k_cache[b, :, n: n + m] = k[b, :, :m]
            v_cache[b, :, n: n + m] = v[b, :, :m]
        keys = torch.cat([k_cache[:, :, :C], k[:, :, M:]], 2)
        values = torch.cat([v_cache[:, :, :C], v[:, :, M:]], 2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def _new_pairs(self, tokens: list[Tensor], dev: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor, list]:
        """([B, M, F*D] features, [B, M] tokens t + 1, per-row counts): every row's context pairs not run yet."""
        d = self.drafter
        new = self._new_positions(tokens)
        feats, ids = self._take_pairs(tokens, new, d.fc.in_features, dev, dtype)
        return feats, ids, new

    def _reserve(self, columns: int, dev: torch.device) -> None:
        """EAGLE-3's layer's cache (``EagleRows``), then the stacked layers' grown alike."""
        have = 0 if self.k is None else self.k.shape[2]
        super()._reserve(columns, dev)
        size = self.k.shape[2]
        if size == have and len(self.upper) == len(self.drafter.upper):
            return
        grown = []
        for i, upper in enumerate(self.drafter.upper):
            layer = upper.layer
            k = torch.zeros(len(self.lengths), layer.num_heads, size, layer.head_dim, device=dev, dtype=self.k.dtype)
            v = torch.zeros_like(k)
            if have and i < len(self.upper):
                k[:, :, :have], v[:, :, :have] = self.upper[i]
            grown.append((k, v))
        self.upper = grown
