"""The eager proposals of the drafter kinds that decode through a static draft step (EAGLE-1 / EAGLE-3, P-EAGLE,
DFlash, DSpark, DFlash2, Medusa): one sequence at a time over growing host-side caches, written to be read. They are
the references each kind's static draft is tested against (tests/test_static_draft.py and the kinds' own tests);
the library decodes every one of these kinds through its static step (``inference.batch_draft``), so they live here.

Beside them: ``Decoder.plain_eager`` (plain decoding through the model's own forward over a ``DynamicCache``, the
reference the decoder's steps match) and ``expand_dynamic_tree`` (one sequence's EAGLE-2 tree).

``install`` (run by tests/conftest.py) puts them on the classes as the ``inference.proposer.Proposer`` calls
(``reset`` / ``observe`` / ``accepted`` / ``propose``) and the helpers they use, so a test can propose through them
directly or decode through per-row copies (``heads.base.ForkedRows``, ``tests.drafters.eager_proposals``) as a
decoder does for a kind without a static draft.

EAGLE: context pairs (target feature at t, token t+1) only ever come from committed tokens, so the drafter's context
KV cache only grows (cropped to the common prefix if asked to re-propose an earlier context); draft nodes keep their
own temporary keys, and ``draft_trees`` grows an EAGLE-2 dynamic tree (``inference.dynamic_tree``) or a top-1 chain
over B rows of context keys and values and a mask of their valid columns (``propose`` passes one row).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import Cache, DynamicCache

from heads.dflash.model import DFlashDrafter
from heads.dflash2.draft import candidates
from heads.dflash2.model import DFlash2Drafter
from heads.dspark.model import DSparkDrafter
from heads.eagle.model import EagleDrafter
from heads.medusa.model import MedusaHeads
from heads.peagle.model import PEagleDrafter
from inference.batch_steps import cut_width
from inference.decoder import Decoder
from inference.dynamic_tree import LevelScore, expand_dynamic_trees
from inference.generation import Generation, cache_kwarg, check_prompt, prefill_kwargs, sync
from inference.sampling import GREEDY, SamplingConfig, sample, seeded_generator, warp
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


def eagle_reset(self, seed: int = 0) -> None:
    self._feats: Tensor | None = None  # [capacity, F*D]: target features of the fed tokens, in order
    self._num_feats = 0
    self._ctx_ids: Tensor | None = None  # [c]: token t+1 of each processed context pair t
    self._ctx_kv: tuple[Tensor, Tensor] | None = None  # [1, h, c, hd] keys / values of the context pairs
    self._ctx_out: Tensor | None = None  # [c, D]: each context pair's output
    self._extends = False  # set by ``accepted``: the next proposal's context extends the processed one


def eagle_observe(self, hidden: dict[int, Tensor]) -> None:
    if not hidden:
        return
    new = torch.cat([hidden[i][0] for i in self.teacher_layers], -1)
    end = self._num_feats + new.shape[0]
    if self._feats is None or end > self._feats.shape[0]:  # grow geometrically: amortised O(1) per token
        grown = new.new_empty((max(2 * end, 64), new.shape[1]))
        if self._feats is not None:
            grown[: self._num_feats] = self._feats[: self._num_feats]
        self._feats = grown
    self._feats[self._num_feats: end] = new
    self._num_feats = end


def eagle_accepted(self, path: list[int], committed: list[int] | None = None) -> None:
    self._extends = True  # the next context extends the processed one: no comparison needed (_advance)


@torch.no_grad()
def eagle_propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
    if max_depth < 1:
        return DraftTree.empty(tokens.device)
    root_out = self._advance(tokens[0])
    depth = min(self.depth or max_depth, max_depth)
    ctx_k, ctx_v = self._ctx_kv
    dev = ctx_k.device
    context = torch.full((1,), tokens.shape[1] - 1, dtype=torch.long, device=dev)
    everything = torch.ones(1, ctx_k.shape[2], dtype=torch.bool, device=dev)
    tree = draft_trees(self, root_out[None], ctx_k, ctx_v, everything, context, depth)[0]
    return DraftTree(tree.tokens.to(tokens.device), tree.parents.to(tokens.device), chain_hint=tree.chain_hint,
                     depth_bound=tree.depth_bound)


def eagle_advance(self, seq: Tensor) -> Tensor:
    """Run the context pairs not yet processed; return the last pair's output [D] (the root of the tree)."""
    need = seq.shape[0] - 1  # pairs (feature of token t, token t+1) for t = 0 .. n-2: every fed token
    if self._num_feats < need:
        raise RuntimeError(f"{self.name}.propose needs target features for {need} tokens, observed "
                           f"{self._num_feats}; the decoder must observe() the prefill and every step")
    feats = self._feats
    dev, dtype = self.fc.weight.device, self.fc.weight.dtype
    seq = seq.to(dev)
    processed = 0 if self._ctx_ids is None else self._ctx_ids.shape[0]
    if self._extends and processed <= need:  # after ``accepted``: the processed pairs are still the context's
        keep = processed
    else:
        keep = self._common_prefix(seq[1: need + 1])
    self._extends = False
    if keep < need:
        x_feats = feats[keep:need].to(dev, dtype)[None]
        hid = self._first_hidden(x_feats)
        emb = self._embed(seq[keep + 1: need + 1][None], hid)
        x, residual = self._layer_input(emb, hid)
        q, k, v = self.layer.qkv(x, torch.arange(keep, need, device=dev))
        if self._ctx_kv is not None:
            k = torch.cat([self._ctx_kv[0][:, :, :keep], k], 2)
            v = torch.cat([self._ctx_kv[1][:, :, :keep], v], 2)
        new = need - keep
        mask = torch.ones(new, need, dtype=torch.bool, device=dev).tril(keep)  # row r sees keys <= keep + r
        window = self.window_mask(torch.arange(keep, need, device=dev)[:, None], torch.arange(need, device=dev))
        mask = mask if window is None else mask & window
        out = self._finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), residual)[0]
        self._ctx_kv = (k, v)
        self._ctx_ids = seq[1: need + 1].clone()
        prev = self._ctx_out[:keep] if self._ctx_out is not None else out[:0]
        self._ctx_out = torch.cat([prev, out])
    return self._ctx_out[need - 1]


def eagle_common_prefix(self, ids: Tensor) -> int:
    """Context pairs still valid for ``ids`` (token t+1 of each pair); a shorter context crops the cache."""
    if self._ctx_ids is None:
        return 0
    n = min(self._ctx_ids.shape[0], ids.shape[0])
    differs = (self._ctx_ids[:n] != ids[:n]).nonzero()
    keep = int(differs[0]) if differs.numel() else n
    if keep < self._ctx_ids.shape[0]:
        self._ctx_kv = (self._ctx_kv[0][:, :, :keep], self._ctx_kv[1][:, :, :keep])
        self._ctx_ids, self._ctx_out = self._ctx_ids[:keep], self._ctx_out[:keep]
    return keep


def peagle_reset(self, seed: int = 0) -> None:
    eagle_reset(self, seed)
    self._upper_kv: list[tuple[Tensor, Tensor]] = []  # per upper layer: the context pairs' keys / values
    self._seed = seed
    self._generator: torch.Generator | None = None


def seeded_sampler(self, device: torch.device) -> torch.Generator:
    """The sequence's draft sampler (``reset``'s seed), made once per device."""
    self._generator = seeded_generator(self._generator, self._seed, device)
    return self._generator


def chain_from(self, logits: Tensor, sampling: SamplingConfig, device: torch.device) -> DraftTree:
    """The chain of ``logits`` [depth, V]: the argmax when greedy, else a draw from each warped row (kept as q)."""
    if sampling.greedy:
        return DraftTree.chain(logits.argmax(-1).to(device))
    probs = warp(logits, sampling)
    drafts = sample(probs, self._sampler(probs.device))
    return DraftTree.chain(drafts.to(device), probs.to(device))


@torch.no_grad()
def peagle_propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
    depth = min(self.depth or self.num_depths, max_depth, self.num_depths)
    if depth < 1:
        return DraftTree.empty(tokens.device)
    return chain_from(self, self.chain_logits(tokens[0], depth), sampling, tokens.device)


def peagle_chain_logits(self, seq: Tensor, depth: int) -> Tensor:
    """[depth, V]: the target-vocabulary logits (-inf outside the draft vocabulary) of the ``depth`` tokens after
    ``seq`` ([n]): the context pairs not processed yet and the depth-1..depth-1 slots in one layer forward."""
    return self.target_logits(self._logits(self._draft(seq.to(self.fc.weight.device), depth)))


def peagle_target_logits(self, draft: Tensor) -> Tensor:
    """[..., V]: draft-vocabulary logits [..., Vd] placed at their target ids, -inf elsewhere."""
    if self.draft_vocab_size == self.dims.vocab_size:
        return draft
    full = draft.new_full((*draft.shape[:-1], self.dims.vocab_size), float("-inf"))
    return full.index_copy(-1, self.d2t, draft)


def peagle_draft(self, seq: Tensor, depth: int) -> Tensor:
    """[depth, D]: the root's output (the last context pair: depth 0) and the ``depth`` - 1 slots' outputs.
    The context pairs' keys are cached (as EAGLE-3's ``_advance``); the slots' are not (they change per step)."""
    need = seq.shape[0] - 1
    if self._num_feats < need:
        raise RuntimeError(f"{self.name}.propose needs target features for {need} tokens, observed "
                           f"{self._num_feats}; the decoder must observe() the prefill and every step")
    processed = 0 if self._ctx_ids is None else self._ctx_ids.shape[0]
    keep = processed if self._extends and processed <= need else self._common_prefix(seq[1: need + 1])
    self._extends = False
    new, S = need - keep, depth - 1
    if new == 0 and S == 0:
        return self._ctx_out[need - 1][None]
    dev, dtype = self.fc.weight.device, self.fc.weight.dtype
    hid = [self._first_hidden(self._feats[keep:need].to(dev, dtype)[None])] if new else []
    emb = [self._embed(seq[keep + 1: need + 1][None], hid[0])] if new else []
    hid.append(self._first_hidden(self.mask_hidden.to(dtype)).expand(1, S, -1))
    emb.append(self._embed(torch.full((1, S), self.mask_token_id, dtype=torch.long, device=dev), hid[-1]))
    x, residual = self._layer_input(torch.cat(emb, 1), torch.cat(hid, 1))
    q, k, v = self.layer.qkv(x, torch.arange(keep, need + S, device=dev))  # slot d sits at position need - 1 + d
    if self._ctx_kv is not None and keep:
        k = torch.cat([self._ctx_kv[0][:, :, :keep], k], 2)
        v = torch.cat([self._ctx_kv[1][:, :, :keep], v], 2)
    rows = torch.arange(keep, need + S, device=dev)[:, None]
    cols = torch.arange(need + S, device=dev)[None, :]
    # a pair sees the pairs <= itself; a slot every pair and the slots <= itself (the same causal rule); with a
    # window, pairs within it of the query's position (the slots' positions are need - 1 + d: their rows)
    mask = cols <= rows
    window = self.window_mask(rows, cols)
    if window is not None:
        mask = mask & (window | (cols >= need))
    mask = mask[None, None]
    out = self.layer.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), residual)
    upper_kv = []
    pos = torch.arange(keep, need + S, device=dev)
    for i, upper in enumerate(self.upper):
        uq, uk, uv = upper.qkv(out, pos)
        if keep:
            uk = torch.cat([self._upper_kv[i][0][:, :, :keep], uk], 2)
            uv = torch.cat([self._upper_kv[i][1][:, :, :keep], uv], 2)
        upper_kv.append((uk[:, :, :need], uv[:, :, :need]))
        out = upper.finish(F.scaled_dot_product_attention(uq, uk, uv, attn_mask=mask), out)
    out = self._output(out)[0]
    if new:
        self._ctx_kv = (k[:, :, :need], v[:, :, :need])
        self._upper_kv = upper_kv
        self._ctx_ids = seq[1: need + 1].clone()
        prev = self._ctx_out[:keep] if self._ctx_out is not None else out[:0]
        self._ctx_out = torch.cat([prev, out[:new]])  # the last layer's outputs (the root's is drafted from)
    return torch.cat([self._ctx_out[need - 1][None], out[new:]])


def peagle_common_prefix(self, ids: Tensor) -> int:
    keep = eagle_common_prefix(self, ids)
    self._upper_kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self._upper_kv]
    return keep


def dflash_reset(self, seed: int = 0) -> None:
    self._seed = seed
    self._generator: torch.Generator | None = None
    self._feats: list[Tensor] = []  # [m, F*D] per observe call: target features of committed positions
    self._num_feats = 0
    self._ctx_kv: list[tuple[Tensor, Tensor]] | None = None  # per layer: [1, g, c, hd] context keys / values
    self._ctx_len = 0


def dflash_observe(self, hidden: dict[int, Tensor]) -> None:
    if not hidden:
        return
    new = torch.cat([hidden[i][0] for i in self.teacher_layers], -1)
    self._feats.append(new)
    self._num_feats += new.shape[0]


def dflash_context_keys(self, need: int) -> list[tuple[Tensor, Tensor]]:
    """Every layer's context keys / values for positions 0 .. need - 1 (computed once per position)."""
    if self._num_feats < need:
        raise RuntimeError(f"{self.name}.propose needs target features for {need} tokens, observed "
                           f"{self._num_feats}; the decoder must observe() the prefill and every step")
    if self._ctx_len < need:
        if len(self._feats) > 1:
            self._feats = [torch.cat(self._feats)]
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        new = self._context(self._feats[0][self._ctx_len: need].to(dev, dtype)[None])
        pos = torch.arange(self._ctx_len, need, device=dev)
        fresh = [layer.self_attn.keys(new, pos) for layer in self.layers]
        if self._ctx_kv is not None:
            fresh = [(torch.cat([k0, k], 2), torch.cat([v0, v], 2))
                     for (k0, v0), (k, v) in zip(self._ctx_kv, fresh)]
        self._ctx_kv, self._ctx_len = fresh, need
    return [(k[:, :, :need], v[:, :, :need]) for k, v in self._ctx_kv]


@torch.no_grad()
def dflash_propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
    depth = min(self.depth or self.block_size - 1, max_depth, self.block_size - 1)
    if depth < 1:
        return DraftTree.empty(tokens.device)
    logits = self._block_logits(tokens[0, -1], tokens.shape[1] - 1)[1: depth + 1]  # [depth, V]
    return chain_from(self, logits, sampling, tokens.device)


def dflash_block_logits(self, anchor: Tensor, position: int) -> Tensor:
    return self.draft_logits(self.block_states(anchor, position))


def dflash_block_states(self, anchor: Tensor, position: int) -> Tensor:
    """[S, D]: the normed states of the whole block [anchor, MASK ...] at ``position`` .. ``position`` + S - 1 over
    the context keys of positions < ``position`` (all of them, or those inside the sliding window of each slot's
    position), as trained (the masked slots attend to one another); row k >= 1 predicts the token at position + k.
    """
    keys = self._context_keys(position)
    dev = self.fc.weight.device
    S = self.block_size
    block = torch.full((1, S), self.mask_token_id, dtype=torch.long, device=dev)
    block[0, 0] = anchor
    h = self._embed(block, self.fc.weight)
    pos = torch.arange(position, position + S, device=dev)
    mask = None
    if self.sliding_window is not None:  # slot k sees context positions within the window of its own position
        sees = (pos[:, None] - torch.arange(position, device=dev)[None, :]) < self.sliding_window
        mask = torch.cat([sees, torch.ones(S, S, dtype=torch.bool, device=dev)], 1)[None, None]
    for layer, (ck, cv) in zip(self.layers, keys):
        h = layer(h, pos, ck, cv, mask)
    return self.norm(h[0])


@torch.no_grad()
def dspark_propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
    depth = min(self.depth or self.block_size - 1, max_depth, self.block_size - 1)
    if depth < 1:
        return DraftTree.empty(tokens.device)
    out = self.block_states(tokens[0, -1], tokens.shape[1] - 1)[1: depth + 1]  # [depth, D]
    anchor = tokens[0, -1:].to(out.device)
    generator = None if sampling.greedy else self._sampler(out.device)
    drafts, probs, kept = draft_chain(self, out[None], anchor, [sampling], [generator])
    n = depth if self.confidence_threshold is None else cut_width(kept[0], depth)
    self.offered += min(n, kept[0])
    if n == 0:
        return DraftTree.empty(tokens.device)
    if probs is None:
        return DraftTree.chain(drafts[0, :n].to(tokens.device))
    return DraftTree.chain(drafts[0, :n].to(tokens.device), probs[0, :n].to(tokens.device))


def draft_chain(drafter, out_BTD: Tensor, anchors_B: Tensor, samplings: list[SamplingConfig],
                generators: list[torch.Generator | None]) -> tuple[Tensor, Tensor | None, list[int]]:
    """Every row's drafts from its slots' states ``out_BTD``, slot by slot (the Markov bias of the token before):
    (drafts [B, T], the sampled rows' draft distributions [B, T, V] (None when every row is greedy), the slots each
    row's confidence cut keeps: T without ``confidence_threshold``). A cut chain offers its verify bucket
    (``inference.batch_steps.cut_width``) filled with drafted tokens, since the bucket's width is paid either way; so with
    the cut the loop stops once every row is cut and the widest row's bucket is drafted; later slots stay -1."""
    B, T, _ = out_BTD.shape
    prev = anchors_B.to(out_BTD.device)
    sampled = [not s.greedy for s in samplings]
    probs = out_BTD.new_zeros(B, T, drafter.dims.vocab_size) if any(sampled) else None
    threshold = drafter.confidence_threshold
    drafts = torch.full((B, T), -1, dtype=torch.long, device=out_BTD.device)
    running = out_BTD.new_ones(B, dtype=torch.float32)  # the product of the confidences so far
    kept = out_BTD.new_zeros(B, dtype=torch.long)
    cut = False  # every row cut
    for k in range(T):
        if cut and k >= cut_width(int(kept.max()), T):
            break
        latent = drafter.latent(prev, out_BTD)
        logits = drafter.slot_logits(out_BTD[:, k], latent)  # [B, V]
        token = logits.argmax(-1)
        for b in (b for b in range(B) if sampled[b]):
            p = warp(logits[b: b + 1], samplings[b])
            probs[b, k] = p[0]
            token[b] = sample(p, generators[b])[0]
        drafts[:, k] = token
        prev = token
        if threshold is not None and not cut:
            running = running * torch.sigmoid(drafter.confidence(out_BTD[:, k], latent).float())
            alive = running >= threshold  # a prefix per row: the product only falls
            kept += alive
            cut = not bool(alive.any())
    if threshold is None:
        return drafts, probs, [T] * B
    return drafts, probs, kept.tolist()


@torch.no_grad()
def dflash2_propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
    if self.candidate_selector is None:
        return dflash_propose(self, tokens, max_depth, sampling)
    depth = min(self.depth or self.block_size - 1, max_depth, self.block_size - 1)
    if depth < 1:
        return DraftTree.empty(tokens.device)
    out = self.block_states(tokens[0, -1], tokens.shape[1] - 1)[1: depth + 1]  # [depth, D]
    generator = None if sampling.greedy else self._sampler(out.device)
    drafts, probs = select_chain(self, out[None], tokens[0, -1:].to(out.device), [sampling], [generator])
    if probs is None:
        return DraftTree.chain(drafts[0].to(tokens.device))
    return DraftTree.chain(drafts[0].to(tokens.device), probs[0].to(tokens.device))


def select_chain(drafter, out_BTD: Tensor, anchors_B: Tensor, samplings: list[SamplingConfig],
                 generators: list[torch.Generator | None]) -> tuple[Tensor, Tensor | None]:
    """Every row's walk over its slots' candidates: (drafts [B, T], the sampled rows' draft distributions [B, T, V],
    None when every row is greedy)."""
    B, T, _ = out_BTD.shape
    unary, cand, projected = candidates(drafter, out_BTD)
    sampled = [not s.greedy for s in samplings]
    probs = out_BTD.new_zeros(B, T, drafter.dims.vocab_size, dtype=torch.float32) if any(sampled) else None
    drafts = torch.empty(B, T, dtype=torch.long, device=out_BTD.device)
    prev = anchors_B.to(out_BTD.device)
    for k in range(T):
        scores = drafter.candidate_selector.scores(prev, projected[:, k], cand[:, k], unary[:, k])  # [B, K]
        pick = scores.argmax(-1)
        for b in (b for b in range(B) if sampled[b]):
            q = warp(scores[b: b + 1], samplings[b])  # [1, K]
            probs[b, k].scatter_(0, cand[b, k], q[0])
            pick[b] = sample(q, generators[b])[0]
        prev = cand[:, k].gather(1, pick[:, None])[:, 0]
        drafts[:, k] = prev
    return drafts, probs


def medusa_reset(self, seed: int = 0) -> None:
    self._last_hidden_1D = None


def medusa_observe(self, hidden: dict[int, Tensor]) -> None:
    # Only the newest position matters: its lm_head output is the pending (bonus) token, and its heads
    # predict the tokens after that.
    self._last_hidden_1D = hidden[-1][:, -1]


@torch.no_grad()
def medusa_propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
    if self._last_hidden_1D is None:
        raise RuntimeError("MedusaHeads.propose called before observe(); the decoder must prefill first")
    return self.draft(self._last_hidden_1D, max_depth)[0]


@torch.no_grad()
def medusa_draft(self, hidden_BD: Tensor, max_depth: int) -> list[DraftTree]:
    """One proposal per row from the target's newest hidden state of each row: the heads run once on [B, D]."""
    depth = min(max_depth, self.num_heads)
    h = hidden_BD.to(self.heads[0][-1].weight.dtype)
    if self.tree is None:
        chains = torch.stack([self.heads[i](h).argmax(-1) for i in range(depth)], 1)  # [B, depth]
        return [DraftTree.chain(chain) for chain in chains]
    ranks, flat, parents, tree_depth = self._static_tree(depth, h.device)
    # Head i's candidates, best first, side by side; the tree's paths pick from them through one index.
    top = torch.cat([self.heads[i](h).topk(r, dim=-1).indices for i, r in enumerate(ranks) if r], 1)
    return [DraftTree(row[flat], parents, chain_hint=False, depth_bound=tree_depth) for row in top]



def expand_dynamic_tree(score: LevelScore, top_k: int, depth: int, total_tokens: int) -> DraftTree:
    """One sequence's tree: ``expand_dynamic_trees`` with a batch of one (``score`` as in the module docstring)."""

    def batched(level: int, parent_slot_BF: Tensor | None, tokens_BF: Tensor | None) -> Tensor:
        if level == 0:
            return score(0, None, None)
        return score(level, parent_slot_BF[0], tokens_BF[0])[None]

    tokens, parents = expand_dynamic_trees(batched, top_k, depth, total_tokens)
    return DraftTree(tokens[0], parents[0], chain_hint=top_k == 1, depth_bound=depth)


def decoder_forward(self, inputs: dict, cache: Cache, layers: tuple[int, ...]):
    out = self.model(**inputs, **{cache_kwarg(self.model): cache}, use_cache=True, output_hidden_states=bool(layers))
    hidden = {i: out.hidden_states[self.teacher.resolve_layer(i)] for i in layers}
    return out.logits[0], hidden  # [m, V], {layer: [1, m, D]}


def decoder_next_token(self, logits_V: Tensor) -> Tensor:
    if self.sampling.greedy:
        return logits_V.argmax(-1, keepdim=True)
    return sample(warp(logits_V[None], self.sampling), self.generator)


@torch.no_grad()
def decoder_plain_eager(self, prompt_ids: Tensor, max_new_tokens: int) -> Generation:
    """``plain`` through the model's own forward and a ``DynamicCache`` (the reference the step path matches)."""
    check_prompt(prompt_ids, max_new_tokens, 0, self.max_positions)
    sync(self.device)
    start = time.perf_counter()
    cache = DynamicCache()
    logits, _ = self._forward({"input_ids": prompt_ids.to(self.device), **prefill_kwargs(self.model)}, cache, ())
    nxt = self._next_token(logits[-1])
    out = [int(nxt)]
    while len(out) < max_new_tokens and out[-1] != self.eos_token_id:
        nxt = self.plain_step(nxt, cache)
        out.append(int(nxt))
    sync(self.device)
    return Generation(new_tokens=self.finish(out, max_new_tokens), seconds=time.perf_counter() - start)


def decoder_plain_step(self, token: Tensor, cache: Cache) -> Tensor:
    """One plain decoding step: feed ``token`` (the last committed one, [1]), return the next ([1], on the
    device). ``plain`` runs it per token; ``inference.cost`` times it as t_plain."""
    logits, _ = self._forward({"input_ids": token.view(1, 1)}, cache, ())
    return self._next_token(logits[-1])


# --- the classes' eager calls --------------------------------------------------------------------------------------

EAGER = {
    EagleDrafter: {"reset": eagle_reset, "observe": eagle_observe, "accepted": eagle_accepted, "propose": eagle_propose,
                   "_advance": eagle_advance, "_common_prefix": eagle_common_prefix},
    PEagleDrafter: {"reset": peagle_reset, "_sampler": seeded_sampler, "propose": peagle_propose,
                    "chain_logits": peagle_chain_logits, "target_logits": peagle_target_logits,
                    "_draft": peagle_draft, "_common_prefix": peagle_common_prefix},
    DFlashDrafter: {"reset": dflash_reset, "observe": dflash_observe, "_context_keys": dflash_context_keys,
                    "_sampler": seeded_sampler, "propose": dflash_propose, "_block_logits": dflash_block_logits,
                    "block_states": dflash_block_states},
    DSparkDrafter: {"propose": dspark_propose},
    DFlash2Drafter: {"propose": dflash2_propose},
    MedusaHeads: {"reset": medusa_reset, "observe": medusa_observe, "propose": medusa_propose, "draft": medusa_draft},
    Decoder: {"_forward": decoder_forward, "_next_token": decoder_next_token, "plain_eager": decoder_plain_eager,
              "plain_step": decoder_plain_step},
}


def install() -> None:
    """Put the eager calls on the drafter classes (once per test session; ``tests/conftest.py`` runs it)."""
    for cls, methods in EAGER.items():
        for name, method in methods.items():
            setattr(cls, name, method)
