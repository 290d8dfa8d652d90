"""A draft LM's chain as one capture-safe step (``inference.static_draft.StaticDraft``): the catch-up on the newly
committed tokens and γ draft tokens, over a KV cache whose buffers never move.

Which token each output predicts: as in ``heads.draft_model`` (the logits after token t predict token t + 1; draft k
is the guess for the k-th token after the pending one).

The cache is the decoder's ``inference.batch_cache.BatchKV`` at one row (a transformers ``Cache``, so the draft
model's own forward fills it), of ``columns`` = capacity + (M + 1) + γ positions, column = position. Columns below
``length`` (this step's own device scalar) hold the committed tokens before the last verification's first row; a forward writes
its n entries at device positions (``BatchKV.place``) by ``index_copy_`` and attends over a capacity bucket under a
4D mask (each query: the columns up to its own position), so every forward of a bucket has one shape. The decoder
picks the bucket on the host before each draft (``use_shape``: the smallest of ``inference.batch_cache``'s buckets
holding the drafts, so attention grows with the sequence as the target's does) and records one step per shape.

Sampled chains (temperature > 0): each draft is drawn from the draft logits warped exactly as the target's
(``inference.sampling.warp``; those rows are ``DraftBuffers.probs_TV``) by inverse CDF from a uniform made inside the
step: a counter-based hash (``hashed_uniforms``) of a per-sequence seed, drawn from the decoder's generator at
``prefill``, and a step counter on the device. A recorded step thus draws fresh uniforms on every replay, with no
generator inside it (dynamo cannot trace one) and no host work before it.

Per ``draft()``: one catch-up forward, the first draft from the pending token's row, then γ - 1 one-token forwards
feeding each draft; ``length`` advances by ``count``. The catch-up, by what the cache already holds:
- after its own draft (what the decoder runs): the cache already holds every committed row but the last draft (the
  first row was the last catch-up's pending token, the accepted drafts were fed at their positions while drafting),
  so it feeds 2 rows: the last committed row (that last draft when the whole chain was accepted, else a row already
  there, fed again) and the pending token;
- otherwise (any committed rows: the default until ``use_shape``): M + 1 rows, the verification's rows
  ``ids_M[:count]``, then the pending token, then padding, whose writes land past the new length and are
  overwritten before they are read.
``prefill`` feeds the prompt but its last token, and leaves that token and the pending one as the first step's
rows.

Shapes: M committed rows, R = M + 1 catch-up rows, γ draft tokens (= M - 1), C cache columns, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.acceptance import sample_uniform
from inference.generation import cache_kwarg
from inference.sampling import SamplingConfig, warp
from inference.batch_cache import BatchKV, kv_shapes
from inference.static_draft import (CommittedBuffers, DraftBuffers, check_prompt_fits, hashed_uniforms, mark_static,
                                    reseed_draws)


class DraftModelStaticDraft:
    """``StaticDraft`` for one ``heads.draft_model.DraftModel`` (a full-attention draft LM) at one capacity bucket:
    a chain of γ = M - 1 tokens, greedy or sampled."""

    def __init__(self, drafter, committed: CommittedBuffers, capacity: int, sampling: SamplingConfig,
                 generator: torch.Generator | None):
        M = committed.ids_M.shape[0]
        if M < 2:
            raise ValueError(f"a draft model needs committed buffers of at least 2 rows (1 + the draft depth), got {M}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 position, got {capacity}")
        self.drafter, self.committed, self.capacity, self.gamma = drafter, committed, capacity, M - 1
        self.model = model = drafter.model  # the one its cache was shaped for
        # the draft model's own context limit: a draft past it is refused on the host (``use_shape``), as the
        # eager proposal refuses it, never decoded into positions the model has no embedding for
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        dev = drafter.device
        R = M + 1
        self.columns = capacity + R + self.gamma
        self.cache = BatchKV(kv_shapes(model), 1, self.columns, dev)  # one row: this sequence's
        for n in (R, 2, 1):
            self.cache.declare(n)
        self.rows = R  # the catch-up's width: R (any committed rows), or 2 after its own draft (``use_shape``)
        self.cache_kwarg = cache_kwarg(model)
        self.length = torch.zeros((), dtype=torch.long, device=dev)
        self.fresh = torch.ones((), dtype=torch.bool, device=dev)  # set by prefill: rows from prefill_ids_R
        self.prefill_ids_R = torch.zeros(R, dtype=torch.long, device=dev)
        self.rows_R = torch.arange(R, device=dev)
        self.cols_C = torch.arange(self.columns, device=dev)
        self.mask_dtype = model.dtype
        self.neg = torch.finfo(model.dtype).min
        self.sampling, self.generator = sampling, generator
        self.seed = torch.zeros((), dtype=torch.long, device=dev)  # per sequence, from the generator (prefill)
        self.counter = torch.zeros((), dtype=torch.long, device=dev)  # draft steps so far: fresh uniforms each
        self.draws_T = torch.arange(self.gamma, device=dev)  # which of a step's uniforms each draft takes
        vocab = drafter.dims.vocab_size
        probs = None if sampling.greedy else torch.zeros(self.gamma, vocab, device=dev)
        self.buffers = DraftBuffers(tokens_T=torch.zeros(self.gamma, dtype=torch.long, device=dev),
                                    parents_T=torch.arange(-1, self.gamma - 1, device=dev), probs_TV=probs, chain=True)
        mark_static(self.length, self.fresh, self.prefill_ids_R, self.rows_R, self.cols_C, self.seed, self.counter,
                    self.draws_T, self.buffers.tokens_T, self.buffers.parents_T,
                    *([probs] if probs is not None else []))

    @torch.no_grad()
    def prefill(self, prompt_ids_P: Tensor, hidden_P: dict[int, Tensor], pending: Tensor) -> None:
        P = prompt_ids_P.shape[0]
        check_prompt_fits("draft model", P, self.capacity)
        dev = self.length.device
        ids = prompt_ids_P.to(dev)
        if P > 1:  # eager: a shape per prompt length is fine here, and attention over the prompt's columns only
            pos = torch.arange(P - 1, device=dev)
            self.cache.place(P - 1, start=pos[0])
            bucket, self.cache.bucket = self.cache.bucket, P - 1
            try:
                self._forward(ids[None, : P - 1], pos)
            finally:
                self.cache.bucket = bucket
        self.prefill_ids_R.zero_()
        self.prefill_ids_R[0] = ids[P - 1]
        self.prefill_ids_R[1] = pending.to(dev)
        self.length.fill_(P - 1)
        self.fresh.fill_(True)
        if not self.sampling.greedy:
            reseed_draws(self.seed, self.counter, self.generator)

    def use_shape(self, context: int, own_draft: bool) -> tuple[int, int]:
        """Host, before a ``draft`` after ``context`` committed tokens (the pending token's position): attention over
        the smallest capacity bucket of ``inference.batch_cache`` holding the drafts' columns (up to ``context`` +
        γ), and a catch-up of 2 rows when the committed rows past the first are this step's own last draft (their
        keys and values are already in the cache, the last draft's aside: feed it and the pending token), else of
        M + 1 (the default: any committed rows). Returns (bucket, catch-up rows): the recorded step's key. A draft
        that would run the draft model past its ``max_position_embeddings`` is refused with the settings to change."""
        if self.max_positions and context + self.gamma > self.max_positions:
            self.drafter._check_positions(context + 1, self.gamma)  # raises, naming the settings to change
        self.rows = 2 if own_draft else self.rows_R.shape[0]
        return self.cache.use_bucket(context + self.gamma), self.rows

    @torch.no_grad()
    def draft(self) -> None:
        c = self.committed
        count = torch.where(self.fresh, 1, c.count)
        if self.rows == 2:  # after its own draft: the last committed row (its last draft, or a re-fed one), pending
            start = self.length + count - 1
            ids_2 = torch.cat([c.ids_M.index_select(0, (count - 1).reshape(1)), c.pending.reshape(1)])
            ids_2 = torch.where(self.fresh, self.prefill_ids_R[:2], ids_2)
            self.cache.place(2, start=start)
            logits = self._forward(ids_2[None], start + self.rows_R[:2])
        else:
            committed_R = torch.cat([c.ids_M, c.ids_M[:1]])
            rows = torch.where(self.rows_R < c.count, committed_R, torch.where(self.rows_R == c.count, c.pending, 0))
            ids_R = torch.where(self.fresh, self.prefill_ids_R, rows)
            self.cache.place(ids_R.shape[0], start=self.length)
            logits = self._forward(ids_R[None], self.length + self.rows_R, count.reshape(1))
        self.length.add_(count)
        self.fresh.fill_(False)
        uniforms = None
        if not self.sampling.greedy:
            uniforms = hashed_uniforms(self.seed, self.counter, self.draws_T)  # [γ]
            self.counter.add_(1)
        token = self._pick(logits, uniforms, 0)  # [1]
        drafts = [token]
        for k in range(1, self.gamma):
            pos = self.cache.place(1, start=self.length + k)[0]
            token = self._pick(self._forward(token[None], pos), uniforms, k)
            drafts.append(token)
        self.buffers.tokens_T.copy_(torch.cat(drafts))

    def _pick(self, logits_1V: Tensor, uniforms: Tensor | None, k: int) -> Tensor:
        """Draft k [1]: the argmax, or a draw from the warped logits (kept as row k of ``probs_TV``)."""
        if uniforms is None:
            return logits_1V.argmax(-1)
        probs_1V = warp(logits_1V, self.sampling)
        self.buffers.probs_TV[k].copy_(probs_1V[0])
        return sample_uniform(probs_1V[0], uniforms[k: k + 1])

    def _forward(self, ids_1n: Tensor, pos_n: Tensor, keep: Tensor | None = None) -> Tensor:
        """Logits [n or len(keep), V] of the rows fed at positions ``pos_n`` (each sees the columns up to its own)."""
        allowed = self.cols_C[None, : self.cache.bucket] <= pos_n[:, None]
        mask = torch.zeros(allowed.shape, dtype=self.mask_dtype, device=allowed.device)
        mask = mask.masked_fill(~allowed, self.neg)[None, None]
        kw = {}
        if self.drafter._logits_to_keep:
            kw["logits_to_keep"] = keep if keep is not None else 1
        kw[self.cache_kwarg] = self.cache
        out = self.model(input_ids=ids_1n, position_ids=pos_n[None], attention_mask=mask, use_cache=True,
                                 **kw)
        logits = out.logits[0]
        if keep is not None and not self.drafter._logits_to_keep:
            return logits.index_select(0, keep)
        return logits if keep is not None else logits[-1:]
