"""Capture-safe decode steps at batch R (a batch bucket: 1, 2, 4, 8, ...; batch 1 is the one-row bucket). Each step
is a function of preallocated buffers only, one per (batch bucket, step bucket), so it is recorded once (a CUDA
graph; ``torch.compile(fullgraph=True)`` once per step kind, its capacity buckets sharing the compilation) and
replayed at every context length of every row.

A bucket is (width, chain, key columns): width 1 is a plain step; width 1 + N verifies N draft nodes (a chain of
γ: N = γ; a tree: N padded up to a multiple of ``TREE_BUCKET``). Nodes a drafter did not fill hold token -1, which
is never accepted (and never removes a token from a sampling residual).

Every row has its own committed length (``inference.batch_cache.BatchKV``); a step feeds each row
[pending, nodes...] at positions ``length[b] + depth``, written at columns ``length[b] .. length[b] + W - 1``. The
4D mask, per row: the committed past (column < length[b]) and, in the new block, each token's ancestors (a chain:
the tokens before it), narrowed per layer type by ``inference.masks``. One forward for all rows; then per row the
acceptance rule of the batch-1 step (``inference.acceptance``: greedy_verdict, rejection_verdict on uniforms drawn
before the step, settle), a tree's accepted path compacted behind that row's pending token, the committed rows and
their hidden states into ``committed_*`` (the drafters' hand-off), ``length[b] += 1 + accepted`` for the rows
still ``active`` (a finished row stays in its bucket, masked and not moving, until the batch is re-bucketed), and
the packed verdicts into ``out`` ``[R, 4 + 2N]``, read back once per step.

Drafts land in ``tokens_RT`` / ``parents_RT`` (padded with token -1, never accepted): written by the draft step at R
rows on the device (``inference.batch_draft``), or copied in by the host from an eager proposal.

Shapes: R rows, W step width (1 + N nodes), C key columns, V vocabulary, M committed rows, D hidden size.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.acceptance import greedy_verdict, rejection_verdict, sample_uniform, settle, typical_verdict
from inference.batch_cache import BatchKV
from inference.static_draft import mark_static
from inference.generation import cache_kwarg
from inference.masks import AttentionLayout
from inference.sampling import SamplingConfig, warp
from inference.tree import DraftTree

TREE_BUCKET = 8  # tree widths are padded to a multiple of this many nodes


@dataclass(frozen=True)
class Bucket:
    """One recorded step shape: ``nodes`` draft nodes (0: a plain step), a chain or a tree, over ``columns`` keys."""

    nodes: int
    chain: bool
    columns: int

    @property
    def width(self) -> int:
        return 1 + self.nodes

    @property
    def packed(self) -> int:
        """Length of the packed verdict: [count, depth, flags, path (N), committed (N + 1)]."""
        return 4 + 2 * self.nodes


def cut_width(size: int, full: int) -> int:
    """The chain bucket a drafter that cuts its own chain (``Proposer.variable_depth``) is verified in: 0 for a chain
    cut to nothing (a plain step), else the smallest power of two holding ``size`` nodes, at most ``full``. A few
    shapes per decode (0, 1, 2, 4, ..., full), each recorded once, instead of the full width for every cut chain."""
    if size < 1:
        return 0
    width = 1
    while width < size:
        width *= 2
    return min(width, max(full, 1))


def tree_nodes(size: int) -> int:
    """A tree of ``size`` nodes runs in the bucket of this many nodes."""
    return -(-size // TREE_BUCKET) * TREE_BUCKET


def batch_geometry(parents_RN: Tensor, depth_bound: int) -> tuple[Tensor, Tensor]:
    """``inference.tree.tree_geometry`` for R trees at once: (depth_RN, ancestors_RNN)."""
    R, n = parents_RN.shape
    idx = torch.arange(n, device=parents_RN.device)
    parents = torch.minimum(parents_RN.clamp(min=-1), idx - 1)
    has_parent = parents >= 0
    up = parents.clamp(min=0)
    eye = torch.eye(n, dtype=torch.bool, device=parents_RN.device).expand(R, n, n)
    ancestors, depth = eye, torch.ones(R, n, dtype=torch.long, device=parents_RN.device)
    for _ in range(max(0, depth_bound - 1)):
        ancestors = eye | (ancestors.gather(1, up[:, :, None].expand(R, n, n)) & has_parent[:, :, None])
        depth = 1 + torch.where(has_parent, depth.gather(1, up), 0)
    return depth, ancestors


class BatchSteps:
    """The static buffers of one target's decode of R rows at one cache capacity, and the step functions over them.

    ``layers``: {hidden-state index a drafter reads: Hugging Face ``hidden_states`` index}; ``max_nodes``: the
    widest draft; ``rows``: M, the committed rows handed to a drafter (1 + the deepest path); ``probs``: room for
    the draft distributions of sampled chains up to ``max_chain`` deep; ``fine``: the steps run uncompiled, so
    attention reads only the columns needed (``inference.batch_cache``)."""

    def __init__(self, model, layout: AttentionLayout, batch: int, capacity: int, vocab_size: int,
                 layers: dict[int, int], max_nodes: int, rows: int, shapes, probs: bool = False, max_chain: int = 0,
                 fine: bool = False):
        self.model, self.layout, self.vocab, self.R = model, layout, vocab_size, batch
        self.layers = dict(layers)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_nodes = max(max_nodes, 0)
        self.max_depth = max(rows - 1, 1)
        self.cache = BatchKV(shapes, batch, capacity, self.device, fine=fine)
        for w in range(1, self.max_nodes + 2):
            self.cache.declare(w)
        self._cache_kw = cache_kwarg(model)
        params = inspect.signature(model.forward).parameters
        self._cache_position = "cache_position" in params
        self._keep = "logits_to_keep" in params  # the prefill computes logits at each prompt's last position only
        long = dict(dtype=torch.long, device=self.device)
        T = max(self.max_nodes, 1)
        self.pending = torch.zeros(batch, **long)
        self.active = torch.zeros(batch, **long)  # 1: the row still decodes (its length moves)
        self.tokens_RT = torch.full((batch, T), -1, **long)
        self.parents_RT = torch.full((batch, T), -1, **long)
        self.probs_RTV = torch.zeros(batch, max_chain, vocab_size, device=self.device) if probs else None
        self.chain_parents = torch.arange(-1, T - 1, **long)
        self.uniforms = torch.zeros(batch, T + 1, device=self.device)
        self.out = torch.zeros(batch, 4 + 2 * T, **long)
        hidden = getattr(model.config.get_text_config(decoder=True), "hidden_size", None) or 1
        M = max(rows, 1)
        self.committed_ids = torch.zeros(batch, M, **long)
        self.committed_hidden = {i: torch.zeros(batch, M, hidden, dtype=self.dtype, device=self.device)
                                 for i in self.layers}
        # A recorded prefill's input (the prompts, padded to a capacity bucket), each row's last prompt index, and
        # its outputs (``prefill_bucket``).
        self.prompt_buf = torch.zeros(batch, capacity, **long)
        self.prompt_last = torch.zeros(batch, **long)
        out_features = getattr(model.get_output_embeddings(), "out_features", None) or vocab_size
        self.first_logits = torch.zeros(batch, out_features, device=self.device)  # float32 holds any logits dtype
        self.prefill_hidden: dict[int, dict[int, Tensor]] = {}
        for t in self.buffers():
            mark_static(t)

    def buffers(self) -> list[Tensor]:
        """Every tensor a step reads or writes besides the model's weights (for address checks and marking)."""
        out = [self.pending, self.active, self.tokens_RT, self.parents_RT, self.chain_parents, self.uniforms,
               self.out, self.committed_ids, *self.committed_hidden.values(), *self.cache.buffers(),
               self.prompt_buf, self.prompt_last, self.first_logits,
               *(h for b in self.prefill_hidden.values() for h in b.values())]
        return out + ([self.probs_RTV] if self.probs_RTV is not None else [])

    # --- the step functions (capture-safe: static shapes, no read-back, writes only into the buffers) -------------
    def plain(self, sampling: SamplingConfig) -> None:
        """One token per row: feed ``pending``, write the next into ``pending`` and ``out[:, 3]``."""
        cache, R = self.cache, self.R
        L = cache.length
        col = cache._arange[: cache.bucket]
        allowed = (col[None, :] <= L[:, None])[:, None, :]
        logits, hidden = self._forward(self.pending[:, None], L[:, None], allowed, col.expand(R, -1), 1)
        if sampling.greedy:
            nxt = logits[:, 0].argmax(-1)
        else:
            nxt = sample_uniform(warp(logits[:, 0], sampling), self.uniforms[:, :1])[:, 0]
        # the hand-off of a step that drafted nothing: the pending token's row (a static draft's catch-up reads it)
        self.committed_ids[:, 0].copy_(self.pending)
        for i, h in hidden.items():
            self.committed_hidden[i][:, 0].copy_(h[:, 0])
        cache.length.add_(self.active)
        self.pending.copy_(nxt)
        self.out[:, :3].zero_()
        self.out[:, 3].copy_(nxt)

    def verify(self, bucket: Bucket, sampling: SamplingConfig, typical: tuple[float, float] | None = None) -> None:
        """Verify every row's first ``bucket.nodes`` nodes (see the module docstring); ``typical``: Medusa's lossy
        rule's (threshold, alpha) instead of the exact one."""
        N, W, cache, R = bucket.nodes, bucket.width, self.cache, self.R
        L = cache.length
        tokens = self.tokens_RT[:, :N]
        parents = self.chain_parents[:N].expand(R, N) if bucket.chain else self.parents_RT[:, :N]
        col = cache._arange[: cache.bucket]
        if bucket.chain:  # row b's token w sits at column and position L[b] + w and sees every column up to its own
            pos = L[:, None] + cache._arange[:W][None, :]
            allowed = col[None, None, :] <= pos[:, :, None]  # [R, W, C]
            k_pos = col.expand(R, -1)
            geometry = None
        else:
            depth_RN, ancestors = batch_geometry(parents, min(N, self.max_depth))
            geometry = (depth_RN, ancestors)
            depth = torch.cat([depth_RN.new_zeros(R, 1), depth_RN], 1)  # [R, W]
            block = torch.eye(W, dtype=torch.bool, device=self.device).repeat(R, 1, 1)
            block[:, :, 0].fill_(True)
            block[:, 1:, 1:] = ancestors
            rel = col[None, :] - L[:, None]  # a column's index inside the row's new block
            in_block = (rel >= 0) & (rel < W)
            rel = rel.clamp(0, W - 1)
            seen = block.gather(2, rel[:, None, :].expand(R, W, rel.shape[1]))
            allowed = (col[None, :] < L[:, None])[:, None, :] | (in_block[:, None, :] & seen)
            k_pos = torch.where(in_block, L[:, None] + depth.gather(1, rel), col[None, :])
            pos = L[:, None] + depth
        ids = torch.cat([self.pending[:, None], tokens.clamp(0, self.vocab - 1)], 1)
        logits, hidden = self._forward(ids, pos, allowed, k_pos, W)
        packed = self._verdicts(bucket, sampling, typical, tokens, parents, logits, geometry)  # [R, 4 + 2N]
        count = packed[:, 0]
        path = packed[:, 3: 3 + N]
        if not bucket.chain:  # a chain's accepted nodes already sit right behind each row's pending token
            cache.keep_path(L + 1, path)
        M = self.committed_ids.shape[1]
        rows = torch.cat([path.new_zeros(R, 1), 1 + path], 1)  # [R, W]: the pending token's row, then the path's
        rows = rows[:, :M] if W >= M else torch.cat([rows, rows.new_zeros(R, M - W)], 1)
        self.committed_ids.copy_(ids.gather(1, rows))
        for i, h in hidden.items():
            self.committed_hidden[i].copy_(h.gather(1, rows[:, :, None].expand(R, M, h.shape[-1])))
        bonus = packed[:, 3 + N:].gather(1, count[:, None])[:, 0]
        cache.length.add_((1 + count) * self.active)
        self.pending.copy_(bonus)
        self.out[:, : bucket.packed].copy_(packed)

    def _verdicts(self, bucket: Bucket, sampling: SamplingConfig, typical: tuple[float, float] | None,
                  tokens_RN: Tensor, parents_RN: Tensor, logits_RWV: Tensor, geometry) -> Tensor:
        """Every row's packed verdict (``settle``), by the batch-1 step's rule, vectorised over the rows with
        ``torch.vmap`` (one traced rule whatever the batch bucket: a compiled step traces it once, not per row);
        uncompiled steps of one or two rows loop instead (vmap's fixed cost per call is larger there)."""
        N = bucket.nodes
        args = [tokens_RN, parents_RN, logits_RWV, self.uniforms[:, : N + 1]]
        probs = self.probs_RTV is not None and bucket.chain and not sampling.greedy and typical is None
        if probs:
            args.append(self.probs_RTV[:, :N])
        if geometry is not None:
            args += list(geometry)

        def row(tokens_N, parents_N, logits_WV, uniforms, *rest):
            valid = tokens_N >= 0
            tree = DraftTree(tokens_N, parents_N, rest[0] if probs else None, chain_hint=bucket.chain,
                             depth_bound=min(N, self.max_depth))
            tree.is_chain = bucket.chain  # on the instance: ``DraftTree`` caches behind a lock a trace must not take
            if geometry is not None:
                tree.geometry = (rest[-2], rest[-1])
            if typical is not None:
                verdict = typical_verdict(tree, warp(logits_WV, sampling), *typical, uniforms=uniforms, valid_N=valid)
            elif sampling.greedy:
                verdict = greedy_verdict(tree, logits_WV.argmax(-1))
            else:
                verdict = rejection_verdict(tree, warp(logits_WV, sampling), uniforms=uniforms, valid_N=valid)
            return settle(tree, *verdict, self.vocab, valid_N=valid)

        if self.R == 1 or (self.cache.fine and self.R <= 2):
            return torch.stack([row(*(a[b] for a in args)) for b in range(self.R)])
        return torch.vmap(row)(*args)

    def _forward(self, ids_RW: Tensor, pos_RW: Tensor, allowed_RWC: Tensor, k_pos_RC: Tensor, W: int):
        cache = self.cache
        where = cache.place(W)
        kw = {self._cache_kw: cache}
        if self._cache_position:
            kw["cache_position"] = where[0]
        mask = self.layout.additive(allowed_RWC, pos_RW, k_pos_RC, self.dtype)
        out = self.model(input_ids=ids_RW, position_ids=pos_RW, attention_mask=mask, use_cache=True,
                         output_hidden_states=bool(self.layers), **kw)
        hidden = {i: out.hidden_states[j] for i, j in self.layers.items()}
        return out.logits, hidden  # [R, W, V], {layer: [R, W, D]}

    def prefill_bucket(self, B: int) -> None:
        """The prompts in ``prompt_buf`` (each row's last index in ``prompt_last``), padded to ``B`` positions,
        through the model into the cache: a step of one shape per bucket, so it is recorded and replayed like the
        others (CUDA graphs, compile). The pads sit after each prompt, so no prompt position sees them; their keys
        land past the row's committed length, masked until a later step overwrites them. Writes each row's last
        prompt position's logits into ``first_logits``, the hidden states into ``prefill_hidden[B]``, and the
        committed lengths."""
        cache, R = self.cache, self.R
        q = cache._arange[:B]
        where = cache.place(B)  # behind length 0 (``load_prompts``)
        kw = {self._cache_kw: cache}
        if self._cache_position:
            kw["cache_position"] = where[0]
        allowed = (q[None, :] <= q[:, None]).expand(R, B, B)  # causal over the bucket
        mask = self.layout.additive(allowed, q.expand(R, B), q.expand(R, B), self.dtype)
        keep = {"logits_to_keep": self.prompt_last} if self._keep else {}
        out = self.model(input_ids=self.prompt_buf[:, :B], position_ids=q.expand(R, B), attention_mask=mask,
                         use_cache=True, output_hidden_states=bool(self.layers), **kw, **keep)
        rows = torch.arange(R, device=self.device)
        # each row's own last position (kept: every row's last positions were computed for every row)
        logits = out.logits[rows, rows] if keep else out.logits[rows, self.prompt_last]
        self.first_logits[:, : logits.shape[-1]].copy_(logits)
        for i, j in self.layers.items():
            self.prefill_hidden[B][i].copy_(out.hidden_states[j])
        cache.length.copy_((self.prompt_last + 1) * self.active)

    # --- eager, outside any recording ------------------------------------------------------------------------------
    def check_width(self, N: int) -> None:
        """Refuses a proposal of ``N`` nodes per row wider than the draft buffers, with the fix."""
        if N > self.max_nodes:
            raise ValueError(f"a proposal of {N} nodes per row is wider than the decoder's {self.max_nodes}; draft a "
                             f"smaller tree (drafter.total_tokens, decoder.tree)")

    def load_trees(self, slots: list[int], trees: list[DraftTree], N: int, chain: bool, sampling: SamplingConfig):
        """Host: each row's eager proposal (``trees[i]`` for row ``slots[i]``) copied into the draft buffers of a
        step of ``N`` nodes, padded with token -1 (a chain's point masses, q = 1 on each drafted token, where no
        distribution came with it); a proposal the step cannot take is refused with the fix."""
        self.check_width(N)
        if not chain and any(t.size and t.depth_bound is not None and t.depth_bound > self.max_depth for t in trees):
            raise ValueError(f"a tree deeper than eval.num_draft={self.max_depth} levels; raise eval.num_draft or "
                             f"draft a shallower tree")
        if not chain and not sampling.greedy and any(t.probs_NV is not None for t in trees):
            raise ValueError("siblings sampled with draft probabilities are not verified by the decoder; draft a "
                             "chain, or point-mass (top-k) siblings")
        self.tokens_RT[:, :N].fill_(-1)
        if not chain:
            self.parents_RT[:, :N].fill_(-1)
        P = self.probs_RTV if chain else None
        if P is not None:
            P[:, :N].zero_()
        for slot, t in zip(slots, trees):
            if not t.size:
                continue
            self.tokens_RT[slot, : t.size].copy_(t.tokens)
            if not chain:
                self.parents_RT[slot, : t.size].copy_(t.parents)
            elif P is not None and t.probs_NV is not None:
                P[slot, : t.size].copy_(t.probs_NV)
            elif P is not None:
                P[slot, : t.size].scatter_(1, t.tokens.view(-1, 1).clamp(0, P.shape[-1] - 1), 1.0)

    def load_prompts(self, prompts: list[Tensor]) -> int:
        """Host: the prompts into ``prompt_buf`` (rows 0 .. n - 1; the bucket's other rows get an empty, inactive
        row) for ``prefill_bucket``; returns its bucket (the smallest capacity bucket holding the longest), whose
        write positions are declared here, before any recording."""
        n, R, cache = len(prompts), self.R, self.cache
        lengths = [int(p.shape[0]) for p in prompts]
        B = cache.use_bucket(max(lengths))
        cache.declare(B)
        cache.reset()
        self.prompt_buf.zero_()
        for b, p in enumerate(prompts):
            self.prompt_buf[b, : lengths[b]].copy_(p)
        self.prompt_last.copy_(torch.tensor([x - 1 for x in lengths] + [0] * (R - n), dtype=torch.long))
        self.active.copy_(torch.tensor([1] * n + [0] * (R - n), dtype=torch.long))
        cache.host_lengths = lengths + [0] * (R - n)
        if B not in self.prefill_hidden:  # the outputs the step writes, allocated before it is traced or recorded
            D = next(iter(self.committed_hidden.values())).shape[-1] if self.layers else 0
            self.prefill_hidden[B] = {i: torch.empty(R, B, D, dtype=self.dtype, device=self.device)
                                      for i in self.layers}
            for t in self.prefill_hidden[B].values():
                mark_static(t)
        return B

    def prefill(self, prompts: list[Tensor]) -> tuple[Tensor, dict[int, Tensor]]:
        """The prompts (rows 0 .. n - 1; the bucket's other rows get an empty, inactive row) through the model into
        the cache, right-padded to the longest (a pad sits after its row's prompt, so no prompt position sees it,
        and the row's first step overwrites it): (each prompt's last logits [n, V], hidden states {layer: [R, P, D]},
        row b's first ``len(prompts[b])`` positions real)."""
        n, R, cache = len(prompts), self.R, self.cache
        lengths = [int(p.shape[0]) for p in prompts]
        P = max(lengths)
        ids = torch.zeros(R, P, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, : lengths[b]] = p.to(self.device)
        cache.reset()
        cache.use_bucket(P)  # checks the prompts fit
        cache.bucket = P  # eager: attention over the prompts' own columns, not a whole bucket
        where = cache.place(P)
        kw = {self._cache_kw: cache}
        if self._cache_position:
            kw["cache_position"] = where[0]
        q = torch.arange(P, device=self.device)
        allowed = (q[None, :] <= q[:, None]).expand(R, P, P)
        mask = self.layout.additive(allowed, q.expand(R, P), q.expand(R, P), self.dtype)
        last = sorted(set(x - 1 for x in lengths)) if self._keep else list(range(P))
        if self._keep:
            kw["logits_to_keep"] = torch.tensor(last, dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, position_ids=q.expand(R, P), attention_mask=mask, use_cache=True,
                         output_hidden_states=bool(self.layers), **kw)
        at = torch.tensor([last.index(x - 1) for x in lengths], dtype=torch.long, device=self.device)
        logits = out.logits[:n].gather(1, at[:, None, None].expand(n, 1, out.logits.shape[-1]))[:, 0]
        cache.set_lengths(lengths + [0] * (R - n))
        self.active.copy_(torch.tensor([1] * n + [0] * (R - n), dtype=torch.long))
        return logits, {i: out.hidden_states[j] for i, j in self.layers.items()}
