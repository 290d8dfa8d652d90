"""EAGLE's eager tree growth (``EagleDrafter.propose``): one drafter forward per tree level, over B rows of context
keys and values and a mask of their valid columns (``propose`` passes one row).

``draft_trees`` runs the EAGLE-2 expansion (``inference.dynamic_tree.expand_dynamic_trees``): a draft node sees its
row's valid context columns (those within the drafter's sliding window of its own position, when it has one) and,
among the step's nodes, its ancestors and itself.

Shapes: B rows, F frontier nodes of one level, S nodes scored so far, C context columns, h heads, hd head size,
D hidden size, Vd draft vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from inference.dynamic_tree import expand_dynamic_trees
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
