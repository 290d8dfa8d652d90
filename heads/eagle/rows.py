"""EAGLE decoding for B sequences at once: one drafter forward per tree level for the whole batch.

``heads.eagle.EagleDrafter`` trains and holds the weights; this module drafts with them. Batch 1 and batch B share
``draft_trees`` (the EAGLE-2 expansion, ``inference.dynamic_tree.expand_dynamic_trees``, over a ragged context); the
batched decoder keeps one ``EagleRows`` per batch (``EagleDrafter.rows``).

The ragged context cache. Row b has processed ``lengths[b]`` context pairs (target feature at t, token t + 1); their
keys and values sit in columns 0 .. lengths[b] - 1 of a preallocated [B, h, capacity, hd] buffer, and ``valid``
[B, capacity] marks them. New pairs are appended in place (one slice copy per row); a draft node sees its row's
valid columns (those within the drafter's sliding window of its own position, when it has one) and, among the
step's nodes, its ancestors and itself. Nothing is concatenated per step but the
step's own nodes, and nothing is read back: positions come from ``valid.sum(1)`` on the device.

Shapes: B rows, F frontier nodes of one level, S nodes scored so far, C context columns, h heads, hd head size,
D hidden size, Vd draft vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.dynamic_tree import expand_dynamic_trees
from inference.sampling import SamplingConfig
from inference.tree import DraftTree


class BatchNodes:
    """Outputs, keys, values and ancestry of the draft nodes scored so far in one proposal per row, indexed by slot
    (the order they were scored, ``inference.dynamic_tree``); all on the device."""

    def __init__(self, root_BD: Tensor):
        self.out = root_BD[:, None]  # [B, 1 + S, D]: the root's output, then each scored node's
        B = root_BD.shape[0]
        self.ancestors = torch.zeros(B, 0, 0, dtype=torch.bool, device=root_BD.device)  # [B, S, S]: itself + ancestors
        self.k: Tensor | None = None  # [B, h, S, hd]
        self.v: Tensor | None = None

    def outputs(self, slot_BF: Tensor) -> Tensor:
        """[B, F, D]: the outputs of the nodes in ``slot_BF`` (-1: the root)."""
        return self.out.gather(1, (slot_BF + 1)[:, :, None].expand(-1, -1, self.out.shape[2]))

    def add(self, parent_slot_BF: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store F new nodes per row (children of ``parent_slot_BF``); return their ancestry rows [B, F, S + F]."""
        B, S = self.ancestors.shape[:2]
        Fn = parent_slot_BF.shape[1]
        padded = torch.cat([self.ancestors.new_zeros(B, 1, S), self.ancestors], 1)
        rows = padded.gather(1, (parent_slot_BF + 1)[:, :, None].expand(B, Fn, S))
        eye = torch.eye(Fn, dtype=torch.bool, device=rows.device).expand(B, Fn, Fn)
        new = torch.cat([rows, eye], 2)
        self.ancestors = torch.cat([torch.cat([self.ancestors, self.ancestors.new_zeros(B, S, Fn)], 2), new], 1)
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return new

    def add_outputs(self, out_BFD: Tensor) -> None:
        self.out = torch.cat([self.out, out_BFD], 1)


def score_level(drafter, level: int, parent_slot_BF: Tensor, tokens_BF: Tensor, nodes: BatchNodes,
                ctx_k: Tensor, ctx_v: Tensor, ctx_mask_BC: Tensor, ctx_len_B: Tensor) -> Tensor:
    """Run one level's frontier nodes of every row (each: its parent's output + its own token, at position
    ctx_len - 1 + level) over the row's context and their ancestors; return their logits [B, F, Vd]."""
    B, Fn = tokens_BF.shape
    parent_out = nodes.outputs(parent_slot_BF)
    emb = drafter._embed(drafter.d2t[tokens_BF], parent_out)
    x, residual = drafter._layer_input(emb, parent_out)
    pos_B = ctx_len_B - 1 + level
    q, k, v = drafter.layer.qkv(x, pos_B[:, None].expand(B, Fn))
    anc = nodes.add(parent_slot_BF, k, v)  # each node sees the whole context and its ancestors and itself
    keys, values = torch.cat([ctx_k, nodes.k], 2), torch.cat([ctx_v, nodes.v], 2)
    C = ctx_mask_BC.shape[1]
    window = drafter.window_mask(pos_B[:, None], torch.arange(C, device=pos_B.device)[None, :])  # [B, C]
    ctx_mask_BC = ctx_mask_BC if window is None else ctx_mask_BC & window
    mask = torch.cat([ctx_mask_BC[:, None, :].expand(B, Fn, C), anc], 2)[:, None]
    out = drafter._finish(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask), residual)
    nodes.add_outputs(out)
    return drafter._logits(out)


def draft_trees(drafter, root_BD: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_mask_BC: Tensor, ctx_len_B: Tensor,
                depth: int) -> list[DraftTree]:
    """Every row's proposal (the drafter's ``tree_mode``: an EAGLE-2 dynamic tree or a top-1 chain), grown in one
    forward per level for the whole batch; tokens are target ids."""
    chain = drafter.tree_mode == "chain"
    nodes = BatchNodes(root_BD)

    def score(level: int, parent_slot_BF: Tensor | None, tokens_BF: Tensor | None) -> Tensor:
        if level == 0:
            return drafter._logits(root_BD)
        return score_level(drafter, level, parent_slot_BF, tokens_BF, nodes, ctx_k, ctx_v, ctx_mask_BC, ctx_len_B)

    tokens, parents = expand_dynamic_trees(score, 1 if chain else drafter.top_k, depth,
                                           depth if chain else drafter.total_tokens)
    tokens = drafter.d2t[tokens]
    return [DraftTree(tokens[b], parents[b], chain_hint=chain, depth_bound=depth) for b in range(tokens.shape[0])]


class EagleRows:
    """The decoding state of B sequences for one ``EagleDrafter`` (``inference.proposer.ProposerRows``): per row the
    observed target features not yet run, and the ragged context cache described in the module docstring."""

    def __init__(self, drafter, batch_size: int):
        self.drafter = drafter
        self.pending: list[list[Tensor]] = [[] for _ in range(batch_size)]  # per row: [m, F*D] features not yet run
        self.lengths = [0] * batch_size  # context pairs processed per row (host: shapes only, never read back)
        self.k: Tensor | None = None  # [B, h, capacity, hd]
        self.v: Tensor | None = None
        self.valid: Tensor | None = None  # [B, capacity] bool
        self.root: Tensor | None = None  # [B, D]: each row's last pair's output (the root of its next tree)

    def __len__(self) -> int:
        return len(self.lengths)

    def observe(self, row: int, hidden: dict[int, Tensor]) -> None:
        if hidden:
            self.pending[row].append(torch.cat([hidden[i][0] for i in self.drafter.teacher_layers], -1))

    def accepted(self, row: int, path: list[int], committed: list[int] | None = None) -> None:
        """Nothing to do: the next proposal's context is the processed one + the newly observed positions."""

    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` (in this order) stay in the batch."""
        self.pending = [self.pending[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        if self.k is not None:
            index = torch.tensor(rows, dtype=torch.long, device=self.k.device)
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
            self.valid, self.root = self.valid.index_select(0, index), self.root.index_select(0, index)

    @torch.no_grad()
    def propose(self, tokens: list[Tensor], depths: list[int], samplings: list[SamplingConfig]) -> list[DraftTree]:
        """Row b's candidates continuing ``tokens[b]`` ([1, n_b]); every row gets the depth min(depths) (drafts are
        top-k picks: the sampling settings do not change them)."""
        if min(depths) < 1:
            return [DraftTree.empty(t.device) for t in tokens]
        self._advance(tokens)
        d = self.drafter
        depth = min(d.depth or min(depths), min(depths))
        C = max(self.lengths)
        ctx_len = self.valid[:, :C].sum(1)
        trees = draft_trees(d, self.root, self.k[:, :, :C], self.v[:, :, :C], self.valid[:, :C], ctx_len, depth)
        return [DraftTree(t.tokens.to(s.device), t.parents.to(s.device), chain_hint=t.chain_hint,
                          depth_bound=t.depth_bound) for t, s in zip(trees, tokens)]

    def _new_positions(self, tokens: list[Tensor]) -> list[int]:
        """Per row, the context positions not run yet, checked against the features observed for them."""
        new = [t.shape[1] - 1 - n for t, n in zip(tokens, self.lengths)]
        for b, m in enumerate(new):
            seen = sum(f.shape[0] for f in self.pending[b])
            if seen != m:
                raise RuntimeError(f"{self.drafter.name}: row {b} proposes after {tokens[b].shape[1]} tokens, which "
                                   f"needs target features for {m} new positions; observed {seen}. The decoder must "
                                   f"observe() the prefill and every committed position once")
        return new

    def _take_pairs(self, tokens: list[Tensor], new: list[int], width: int, dev: torch.device,
                    dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """([B, M, width] features, [B, M] tokens t + 1) of every row's new pairs, padded to the longest; the
        observed features are consumed."""
        feats = torch.zeros(len(tokens), max(new), width, device=dev, dtype=dtype)
        ids = torch.zeros(len(tokens), max(new), dtype=torch.long, device=dev)
        for b, m in enumerate(new):
            if m:
                feats[b, :m] = torch.cat(self.pending[b]).to(dev, dtype)
                ids[b, :m] = tokens[b][0, self.lengths[b] + 1:].to(dev)
            self.pending[b] = []
        return feats, ids

    def _advance(self, tokens: list[Tensor]) -> None:
        """Run every row's context pairs not yet processed (pair t = feature of token t, token t + 1), padded to the
        longest; append their keys and values to the rows' caches; keep each row's last output as its root."""
        d = self.drafter
        dev, dtype = d.fc.weight.device, d.fc.weight.dtype
        new = self._new_positions(tokens)
        M = max(new)
        if M == 0:
            return
        B = len(tokens)
        width = d.fc.in_features if d.variant == "eagle3" else d.dims.hidden_size
        feats, ids = self._take_pairs(tokens, new, width, dev, dtype)
        self._reserve(max(n + m for n, m in zip(self.lengths, new)), dev)
        start = self.valid.sum(1)  # [B]: the first new pair's position per row
        pos = start[:, None] + torch.arange(M, device=dev)
        hid = d._first_hidden(feats)
        x, residual = d._layer_input(d._embed(ids, hid), hid)
        q, k, v = d.layer.qkv(x, pos)
        for b, (n, m) in enumerate(zip(self.lengths, new)):
            self.k[b, :, n: n + m] = k[b, :, :m]
            self.v[b, :, n: n + m] = v[b, :, :m]
            self.valid[b, n: n + m].fill_(True)
        C = max(n + m for n, m in zip(self.lengths, new))
        cols = torch.arange(C, device=dev)
        # [B, M, C]: a row's columns below its position are its own pairs (contiguous from 0); the columns a padding
        # query (m <= i < M) may see past them hold stale keys, and its output is never used.
        mask = cols[None, None, :] <= pos[:, :, None]
        window = d.window_mask(pos[:, :, None], cols[None, None, :])
        mask = mask if window is None else mask & window
        out = d._finish(F.scaled_dot_product_attention(q, self.k[:, :, :C], self.v[:, :, :C],
                                                            attn_mask=mask[:, None]), residual)
        last = torch.stack([out[b, max(m - 1, 0)] for b, m in enumerate(new)])
        if self.root is not None:
            fresh = torch.tensor([m > 0 for m in new], device=dev)[:, None] if min(new) == 0 else None
            last = last if fresh is None else torch.where(fresh, last, self.root)
        self.root = last
        self.lengths = [n + m for n, m in zip(self.lengths, new)]

    def _reserve(self, columns: int, dev: torch.device) -> None:
        """Room for ``columns`` context columns per row, grown geometrically (amortised O(1) per token)."""
        have = 0 if self.k is None else self.k.shape[2]
        if columns <= have:
            return
        layer, B = self.drafter.layer, len(self.lengths)
        size = max(2 * columns, 64)
        dtype = self.drafter.fc.weight.dtype
        k = torch.zeros(B, layer.num_heads, size, layer.head_dim, device=dev, dtype=dtype)
        v, valid = torch.zeros_like(k), torch.zeros(B, size, dtype=torch.bool, device=dev)
        if have:
            k[:, :, :have], v[:, :, :have], valid[:, :have] = self.k, self.v, self.valid
        self.k, self.v, self.valid = k, v, valid
