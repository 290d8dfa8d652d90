"""Capture-safe decode steps at batch 1: each step is a function of preallocated buffers only, one per shape bucket,
so it can be recorded once (``torch.compile(fullgraph=True, dynamic=False)``, a CUDA graph) and replayed at every
context length.

A bucket is (width, chain, key columns): width 1 is a plain step; width 1 + N verifies N draft nodes (a chain of
γ: N = γ; a tree: N padded up to a multiple of ``TREE_BUCKET``). Nodes a drafter did not fill hold token -1, which
is never accepted (and never removes a token from a sampling residual). Inside one step, in order:
1. the inputs: [pending, nodes (clamped into the vocabulary)] at positions ``length + depth``, written into the
   static cache at columns ``length .. length + width - 1``;
2. the 4D mask over the whole capacity bucket: the committed past (column < length) and, in the new block, each
   token's ancestors (sliding-window layers only within their window: ``inference.masks``);
3. the model's own forward;
4. the acceptance rule on the device (``inference.acceptance``: greedy_verdict, rejection_verdict on uniforms drawn
   before the step, settle), packed into ``out``;
5. compaction of a tree's accepted path behind the pending token (a fixed-size gather), the committed rows and their
   hidden states into ``CommittedBuffers`` (the drafter's hand-off), ``length += 1 + accepted``, and the next
   pending token.
The host reads ``out`` back once per step (``StepDecoder`` in ``inference.step_decoder``).

Shapes: W step width (1 + N nodes), C key columns of the bucket, V vocabulary, M committed rows, D hidden size.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.acceptance import greedy_verdict, rejection_verdict, sample_uniform, settle
from inference.generation import cache_kwarg
from inference.masks import AttentionLayout
from inference.sampling import SamplingConfig, warp
from inference.static_cache import StaticKV, _mark_static, kv_shapes
from inference.static_draft import CommittedBuffers, DraftBuffers, new_committed
from inference.tree import DraftTree, tree_geometry

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


class Steps:
    """The static buffers of one target's batch-1 decode at one cache capacity, and the step functions over them.

    ``layers``: {hidden-state index the drafter reads: Hugging Face ``hidden_states`` index}; ``max_nodes``: the
    widest draft; ``rows``: M, the committed rows handed to a drafter (1 + the deepest path)."""

    def __init__(self, model, layout: AttentionLayout, capacity: int, vocab_size: int, layers: dict[int, int],
                 max_nodes: int, rows: int, probs: bool = False, shapes=None):
        self.model = model
        self.layout = layout
        self.vocab = vocab_size
        self.layers = dict(layers)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_nodes = max(max_nodes, 0)
        # The deepest draft a step verifies (M - 1): a tree's geometry takes this many rounds, not one per node.
        self.max_depth = max(rows - 1, 1)
        widths = sorted({1, *range(2, self.max_nodes + 2)})
        self.cache = StaticKV(shapes or kv_shapes(model), capacity, self.device, widths=tuple(widths))
        self._cache_kw = cache_kwarg(model)
        self._cache_position = "cache_position" in inspect.signature(model.forward).parameters
        long = dict(dtype=torch.long, device=self.device)
        T = max(self.max_nodes, 1)
        self.pending = torch.zeros((), **long)
        # The draft the next verification reads (an eager drafter's proposal is copied in; a static drafter's
        # own ``DraftBuffers`` replace these with ``use_draft``).
        self.own_draft = DraftBuffers(tokens_T=torch.full((T,), -1, **long), parents_T=torch.arange(-1, T - 1, **long),
                                      probs_TV=torch.zeros(T, vocab_size, device=self.device) if probs else None)
        self.draft = self.own_draft
        self.chain_parents = torch.arange(-1, T - 1, **long)
        self.uniforms = torch.zeros(T + 1, device=self.device)  # the sampling draws of the next step
        self.out = torch.zeros(4 + 2 * T, **long)  # the packed verdict the host reads back
        # A recorded prefill's input (the prompt, padded to its bucket) and outputs (``prefill_bucket``).
        self.prompt_buf = torch.zeros(capacity, **long)
        self.prompt_last = torch.zeros(1, **long)
        out_features = getattr(model.get_output_embeddings(), "out_features", None) or vocab_size
        self.first_logits = torch.zeros(out_features, device=self.device)  # float32 holds any logits dtype exactly
        self.prefill_hidden: dict[int, dict[int, Tensor]] = {}
        hidden = getattr(model.config.get_text_config(decoder=True), "hidden_size", None)
        self.committed: CommittedBuffers = new_committed(max(rows, 1), tuple(self.layers), hidden or 1, self.device,
                                                         self.dtype)
        for t in self.buffers():
            _mark_static(t)

    def buffers(self) -> list[Tensor]:
        """Every tensor a step reads or writes besides the model's weights (for address checks and marking)."""
        c, d = self.committed, self.draft
        out = [self.pending, self.chain_parents, self.uniforms, self.out, d.tokens_T, d.parents_T,
               c.ids_M, c.count, c.position, c.pending, *c.hidden_M.values(), *self.cache.buffers(),
               self.prompt_buf, self.prompt_last, self.first_logits,
               *(h for b in self.prefill_hidden.values() for h in b.values())]
        return out + ([d.probs_TV] if d.probs_TV is not None else [])

    def use_draft(self, draft: DraftBuffers | None) -> None:
        """Verify from a static drafter's buffers (None: this object's own, which eager proposals are copied into)."""
        self.draft = draft or self.own_draft

    # --- the step functions (capture-safe: static shapes, no read-back, writes only into the buffers) -------------
    def plain(self, sampling: SamplingConfig) -> None:
        """One token: feed ``pending``, write the next one into ``pending`` and ``out`` ([0, 0, 0, token]). In a
        speculative decode (buffers for draft nodes: this step verifies an empty draft) the fed token is also the
        drafter's one committed row, as a verification hands them over (the batched plain step does the same)."""
        cache = self.cache
        L = cache.length
        col = cache._arange[: cache.bucket]
        pos = L.view(1, 1)
        allowed = (col <= L).view(1, 1, -1)
        logits, hidden = self._forward(self.pending.view(1, 1), pos, allowed, col.view(1, -1), 1)
        if sampling.greedy:
            nxt = logits[0].argmax(-1, keepdim=True)
        else:
            nxt = sample_uniform(warp(logits, sampling)[0], self.uniforms[:1])
        if self.max_nodes:
            c = self.committed
            c.ids_M[:1].copy_(self.pending.view(1))
            for i, h in hidden.items():
                c.hidden_M[i][:1].copy_(h[:1])
            c.count.fill_(1)
            c.position.copy_(L)
            c.pending.copy_(nxt[0])
        cache.length.add_(1)
        self.pending.copy_(nxt[0])
        self.out[:3].zero_()
        self.out[3:4].copy_(nxt)

    def verify(self, bucket: Bucket, sampling: SamplingConfig) -> None:
        """Verify the first ``bucket.nodes`` nodes of ``draft`` (see the module docstring)."""
        N, W, cache, d = bucket.nodes, bucket.width, self.cache, self.draft
        L = cache.length
        tokens = d.tokens_T[:N]
        parents = self.chain_parents[:N] if bucket.chain else d.parents_T[:N]
        probs = d.probs_TV[:N] if (d.probs_TV is not None and bucket.chain and not sampling.greedy) else None
        valid = tokens >= 0
        tree = DraftTree(tokens, parents, probs, chain_hint=bucket.chain, depth_bound=min(N, self.max_depth))
        # The shape facts the rules read, set on the instance (``DraftTree`` caches them behind a lock that a
        # traced step must not take; a chain's rules read no geometry).
        tree.is_chain = bucket.chain
        col = cache._arange[: cache.bucket]
        if bucket.chain:  # token w sits at column and position L + w and sees every column up to its own
            pos = L + cache._arange[:W]
            allowed = col[None, :] <= pos[:, None]  # [W, C]
            k_pos = col
        else:
            depth_N, ancestors_NN = tree_geometry(parents, min(N, self.max_depth))
            tree.geometry = (depth_N, ancestors_NN)
            depth = torch.cat([depth_N.new_zeros(1), depth_N])  # [W]
            block = torch.eye(W, dtype=torch.bool, device=self.device)
            block[:, 0].fill_(True)
            block[1:, 1:] = ancestors_NN
            rel = col - L  # a column's index inside the new block
            in_block = (rel >= 0) & (rel < W)
            rel = rel.clamp(0, W - 1)
            allowed = (col < L)[None, :] | (in_block[None, :] & block[:, rel])  # [W, C]
            k_pos = torch.where(in_block, L + depth[rel], col)
            pos = L + depth
        ids = torch.cat([self.pending.view(1), tokens.clamp(0, self.vocab - 1)])
        logits, hidden = self._forward(ids.view(1, W), pos.view(1, W), allowed[None], k_pos.view(1, -1), W)
        if sampling.greedy:
            on_path, last, bonus = greedy_verdict(tree, logits.argmax(-1))
        else:
            on_path, last, bonus = rejection_verdict(tree, warp(logits, sampling), uniforms=self.uniforms[: N + 1],
                                                     valid_N=valid)
        packed = settle(tree, on_path, last, bonus, self.vocab, valid_N=valid)
        count = packed[0]
        path = packed[3: 3 + N]
        if not bucket.chain:  # a chain's accepted nodes already sit right behind the pending token
            cache.keep_path(L + 1, path)
        c = self.committed
        M = c.ids_M.shape[0]
        if bucket.chain:  # the accepted nodes follow the pending token: rows 0 .. count (then padding, or stale
            n = min(W, M)  # rows past W, which count never reaches)
            c.ids_M[:n].copy_(ids[:n])
            for i, h in hidden.items():
                c.hidden_M[i][:n].copy_(h[:n])
        else:
            rows = torch.cat([path.new_zeros(1), 1 + path])  # [W]: the pending token's row, then the path's
            rows = rows[:M] if W >= M else torch.cat([rows, rows.new_zeros(M - W)])
            c.ids_M.copy_(ids.index_select(0, rows))
            for i, h in hidden.items():
                c.hidden_M[i].copy_(h.index_select(0, rows))
        c.count.copy_(1 + count)
        c.position.copy_(L)
        c.pending.copy_(bonus[0])
        cache.length.add_(1 + count)
        self.pending.copy_(bonus[0])
        self.out[: bucket.packed].copy_(packed)

    def _forward(self, ids_1W: Tensor, pos_1W: Tensor, allowed_1WC: Tensor, k_pos_1C: Tensor, W: int):
        cache = self.cache
        where = cache.place(W)
        kw = {self._cache_kw: cache}
        if self._cache_position:
            kw["cache_position"] = where
        mask = self.layout.additive(allowed_1WC, pos_1W, k_pos_1C, self.dtype)
        out = self.model(input_ids=ids_1W, position_ids=pos_1W, attention_mask=mask, use_cache=True,
                         output_hidden_states=bool(self.layers), **kw)
        hidden = {i: out.hidden_states[j][0] for i, j in self.layers.items()}
        return out.logits[0], hidden  # [W, V], {layer: [W, D]}

    def prefill_bucket(self, B: int, prefill_kw: dict) -> None:
        """The prompt in ``prompt_buf`` (its last index in ``prompt_last``), padded to ``B`` positions, through the
        model into the cache: a step of one shape per bucket, so it is recorded and replayed like the others (CUDA
        graphs, compile). The pads sit after the prompt, so no prompt position sees them; their keys land past the
        committed length, masked until a later step overwrites them. Writes the last prompt position's logits into
        ``first_logits`` and the hidden states into ``prefill_hidden[B]``; sets the committed length."""
        cache = self.cache
        q = cache._arange[:B]
        where = cache.place(B)  # behind length 0 (``load_prompt``)
        kw = {self._cache_kw: cache}
        if self._cache_position:
            kw["cache_position"] = where
        allowed = (q[None, :] <= q[:, None])[None]  # causal over the bucket
        mask = self.layout.additive(allowed, q[None], q[None], self.dtype)
        keep = {"logits_to_keep": self.prompt_last} if "logits_to_keep" in prefill_kw else {}
        out = self.model(input_ids=self.prompt_buf[:B].view(1, B), position_ids=q[None], attention_mask=mask,
                         use_cache=True, output_hidden_states=bool(self.layers), **kw, **keep)
        logits = out.logits[0] if keep else out.logits[0].index_select(0, self.prompt_last)
        self.first_logits[: logits.shape[-1]].copy_(logits[0])
        for i, j in self.layers.items():
            self.prefill_hidden[B][i].copy_(out.hidden_states[j][0])
        cache.length.copy_(self.prompt_last[0] + 1)

    # --- eager, outside any recording ------------------------------------------------------------------------------
    def load_prompt(self, prompt_P: Tensor) -> int:
        """Host: the prompt into ``prompt_buf`` for ``prefill_bucket``; returns its bucket (the smallest capacity
        bucket holding it), whose write positions are declared here, before any recording."""
        P = prompt_P.shape[0]
        cache = self.cache
        B = cache.use_bucket(P)
        cache.declare(B)
        cache.reset()
        self.prompt_buf[:P].copy_(prompt_P)
        self.prompt_buf[P:B].zero_()
        self.prompt_last.fill_(P - 1)
        if B not in self.prefill_hidden:  # the outputs the step writes, allocated before it is traced or recorded
            D = self.committed.hidden_M[next(iter(self.layers))].shape[-1] if self.layers else 0
            self.prefill_hidden[B] = {i: torch.empty(B, D, dtype=self.dtype, device=self.device) for i in self.layers}
            for t in self.prefill_hidden[B].values():
                _mark_static(t)
        return B

    def prefill(self, prompt_P: Tensor, prefill_kw: dict) -> tuple[Tensor, dict[int, Tensor]]:
        """The prompt through the model into the static cache (eager, any length): (last logits [V], hidden states
        {layer: [P, D]}). The caller sets ``pending``."""
        P = prompt_P.shape[0]
        cache = self.cache
        cache.reset()
        cache.use_bucket(P)  # checks the prompt fits
        cache.bucket = P  # eager: attention over the prompt's own columns, not a whole bucket
        cache.place(P)
        kw = {self._cache_kw: cache}
        if self._cache_position:
            kw["cache_position"] = cache.positions(P)
        col = cache._arange[: cache.bucket]
        q = torch.arange(P, device=self.device)
        allowed = (col[None, :] <= q[:, None])[None]
        mask = self.layout.additive(allowed, q[None], col[None], self.dtype)
        out = self.model(input_ids=prompt_P.view(1, P), position_ids=q[None], attention_mask=mask, use_cache=True,
                         output_hidden_states=bool(self.layers), **kw, **prefill_kw)
        cache.set_length(P)
        return out.logits[0, -1], {i: out.hidden_states[j][0] for i, j in self.layers.items()}
