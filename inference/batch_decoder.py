"""Batched decoding, plain and speculative, through recorded steps (``inference.batch_steps``): B sequences share one
target forward per step, each accepts its own number of tokens.

Why: speculation buys single-stream latency with spare compute. Under a large batch the target forward is already
busy, so the wider verification block competes with other sequences' tokens; ``inference.policy`` decides per step
whether speculating still pays. This module is the mechanism; the sweep is ``eval.batch_sweep``.

Per decode: the prompts go into the rows of a batch bucket (1, 2, 4, 8, ...: the smallest holding them) in one
eager forward, right-padded; then per step the host
1. drafts: a drafter with a batch-1 static draft (``static_draft``, ``inference.static_draft``: EAGLE-1/3, Medusa,
   DFlash, DSpark, P-EAGLE, a full-attention draft model) runs its draft step at the bucket's rows
   (``inference.batch_draft``: the batch-1 step vmapped over the rows' stacked states, each row catching up on what
   it committed itself), compiled or recorded like the verify steps, writing the step's draft buffers on the device;
   rows near the end of their budget get token -1 past the tokens they still need, and a drafter that cuts its own
   chains (DSpark's confidence cut) is verified in the bucket of the longest row's cut (one read-back of every row's
   kept count), as at batch 1. Where steps run uncompiled and unrecorded (a CPU by default: ``static_drafts``) and
   for any other drafter (lookup, a drafter or setting without a static draft, one whose draft the batched verify
   cannot take), the drafter proposes through its eager batch state (``drafter.rows(seeds)``,
   ``inference.proposer.ProposerRows``: EAGLE one forward per tree level for every row, a draft model one forward per
   draft step, DFlash and P-EAGLE one forward, the others per-row copies) and each row's chain or tree is copied into
   the step's fixed buffers, padded with token -1. A plain step (γ = 0 from the load-aware policy) verifies nothing
   drafted; a static draft step still runs before it, its catch-up keeping the rows' draft state in step;
2. fills the sampling draws (one ``torch.rand`` into a static buffer);
3. runs the step of the bucket (batch bucket, width, chain or tree, capacity bucket): eager,
   ``torch.compile(fullgraph=True, dynamic=False)`` or a CUDA graph replay, as the batch-1 step decoder
   (``inference.step_decoder``) runs its own, whose settings and compile / record machinery this decoder shares;
4. reads every row's packed verdict back at once, and does the host's bookkeeping (committed tokens, EOS, the
   drafter's ``observe`` / ``accepted``).
A finished row (``max_new_tokens`` or EOS) stays in its bucket, inactive (its length no longer moves, its verdicts
are ignored), until at most half the bucket is live: the live rows then move to the smallest bucket holding them
(their cache rows, and a static draft's state rows, copied once). Each row is decoded losslessly: greedy rows are
token-identical to batch-1 greedy decoding, sampled rows are distributed as the target (tests/test_batch_decoder.py).

Shapes: B prompts, R rows of the batch bucket, N draft nodes per row, V vocabulary.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference.batch_draft import NotStackable, RowDrafts, static_of
from inference.batch_steps import BatchSteps
from inference.generation import Generation, check_prompt, check_vocab, finish, sync
from inference.proposer import Proposer, ProposerRows
from inference.sampling import GREEDY, SamplingConfig, sample, warp
from inference.static_cache import kv_shapes
from inference.static_draft import DraftBuffers, weights_signature
from inference.stats import AcceptStats
from inference.step_decoder import MAX_NODES, STATIC_KEPT, StepDecoder, _capacity, clip_tree
from inference.steps import Bucket, cut_width, tree_nodes
from inference.tree import DraftTree, raise_bad_parents, raise_bad_tokens

log = logging.getLogger(__name__)

Policy = Callable[[int], int]  # live batch size -> draft tokens (γ) for this step; 0 = a plain step


def check_batch(prompts: Sequence, max_new_tokens: int, lookahead: int, max_positions: int) -> list[Tensor]:
    """Prompts as 1-D long tensors; errors name the prompt and the fix."""
    if len(prompts) == 0:
        raise ValueError("no prompts: a batch needs at least one")
    out = []
    for i, p in enumerate(prompts):
        ids = torch.as_tensor(p, dtype=torch.long).reshape(1, -1)
        try:
            check_prompt(ids, max_new_tokens, lookahead, max_positions)
        except ValueError as e:
            raise ValueError(f"prompt {i} of the batch of {len(prompts)}: {e}") from None
        out.append(ids[0])
    return out


def batch_bucket(rows: int) -> int:
    """The batch bucket of ``rows`` live rows: the smallest power of two holding them."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


@dataclass
class BatchGeneration:
    """One batched decode. ``generations[i]`` is prompt i's (input order); its ``seconds`` is the time from the start
    of the batch to that sequence leaving it (its latency)."""

    generations: list[Generation]
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    compile_seconds: float = 0.0  # first calls of compiled steps (left out of every time above)
    steps: int = 0
    stats: AcceptStats = field(default_factory=AcceptStats)
    gamma_steps: Counter = field(default_factory=Counter)  # γ chosen -> steps
    live_steps: Counter = field(default_factory=Counter)  # live batch size -> steps
    bucket_steps: Counter = field(default_factory=Counter)  # batch bucket -> steps
    step_log: list = field(default_factory=list)  # per step: (live rows, γ, draft seconds, verify seconds)

    @property
    def new_tokens(self) -> int:
        return sum(len(g.new_tokens) for g in self.generations)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def latency_ms_per_token(self) -> float:
        """Mean over sequences of (time to leave the batch) / (its new tokens), in ms."""
        per = [1000 * g.seconds / len(g.new_tokens) for g in self.generations if g.new_tokens]
        return sum(per) / len(per) if per else 0.0


@dataclass
class _Row:
    """A live sequence: its prompt index, its row in the current bucket, what it committed."""

    index: int
    slot: int
    new: list[int]
    gen: Generation
    m: int  # prompt + committed tokens in ``_Batch.seq`` (what a drafter proposes from)


@dataclass
class _Batch:
    """One decode's moving parts."""

    state: BatchSteps
    live: list[_Row]  # in the drafter state's row order
    draft: ProposerRows | None  # the eager rows (a drafter without a static draft here)
    seq: Tensor | None  # [B, prompt + new + room]: each prompt's committed tokens (eager drafting only)
    sampling: SamplingConfig
    key: tuple  # the state's shape apart from its batch bucket
    static: RowDrafts | None = None  # the capture-safe draft step at the bucket's rows
    drafter: Proposer | None = None
    num_draft: int = 0


class BatchStepDecoder:
    """Decodes a batch of prompts with a frozen target (a ``distill.teacher.Teacher``) and, optionally, a drafter.
    ``steps``: the batch-1 step decoder whose settings (CUDA graphs, compile) and generator this one shares (None: a
    new one, on a generator seeded with ``seed`` unless ``generator`` is given). ``static_drafts``: True drafts
    through the drafter's static draft step at the bucket's rows (``inference.batch_draft``) where it has one, False
    through the eager rows; auto (the default): the static step where steps are compiled or recorded (a CUDA target
    by default), the eager rows otherwise (uncompiled, the vmapped step costs ~1.7x the eager rows' time on a CPU)."""

    def __init__(self, teacher, eos_token_id: int | None = None, sampling: SamplingConfig = GREEDY, seed: int = 0,
                 generator: torch.Generator | None = None, cuda_graphs: str = "auto", compile: str | bool = "auto",
                 compile_backend: str | None = None, steps: StepDecoder | None = None,
                 typical: tuple[float, float] | None = None, max_rows: int | None = None,
                 static_drafts: bool | str = "auto"):
        self.teacher = teacher
        if static_drafts not in (True, False, "auto"):
            raise ValueError(f"static_drafts={static_drafts!r}; valid: True, False, 'auto'")
        self.model = teacher.model
        self.device = teacher.device
        self.eos_token_id = eos_token_id
        self.sampling = sampling
        self.max_positions = teacher.max_positions
        if steps is None:
            generator = generator or torch.Generator(device=self.device).manual_seed(seed)
            steps = StepDecoder(teacher, eos_token_id, sampling, generator, cuda_graphs=cuda_graphs, compile=compile,
                                compile_backend=compile_backend)
        self.owner = steps
        self.static_drafts = (steps.compile or steps.graphs) if static_drafts == "auto" else static_drafts
        self.typical = typical  # (threshold, alpha) of Medusa's typical acceptance (LOSSY), or None: the exact rule
        if max_rows is not None and (max_rows < 1 or max_rows & (max_rows - 1)):
            raise ValueError(f"decoder.max_batch_rows={max_rows}: the largest batch bucket must be a power of two "
                             f">= 1 (1, 2, 4, 8, ...), or null for no cap")
        self.max_rows = max_rows  # the largest batch bucket; more prompts are decoded in consecutive groups of it
        self.generator = steps.generator
        self._shapes = None
        self._states: dict[tuple, BatchSteps] = {}
        self._fns: dict[tuple, object] = {}  # keyed by (id(state), ...): dropped with the buffers they read
        self._drafts: dict[tuple, RowDrafts] = {}  # (id(state), id(batch-1 draft), weights) -> its rows
        self._committed: dict[tuple, object] = {}  # shape -> the batch-1 committed buffers static drafts are made for

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def describe(self) -> dict:
        """How the steps ran (the batch-1 step decoder's figures, which include these steps' compilation)."""
        return {**self.owner.describe(), "batch_step_functions": len(self._fns)}

    @torch.no_grad()
    def plain(self, prompts: Sequence, max_new_tokens: int, sampling=None) -> BatchGeneration:
        """Autoregressive decoding of every prompt: one batched target forward per token."""
        return self._groups(None, prompts, max_new_tokens, 0, None, sampling)

    @torch.no_grad()
    def speculative(self, drafter: Proposer, prompts: Sequence, max_new_tokens: int, num_draft: int,
                    policy: Policy | None = None, sampling=None) -> BatchGeneration:
        """Speculative decoding of every prompt; lossless per row. ``policy(live rows) -> γ`` picks each step's draft
        length (0: a plain step); None drafts ``num_draft`` every step. ``sampling``: one ``SamplingConfig`` for the
        batch (or a list of one per prompt, all equal), None for the decoder's."""
        check_vocab(drafter, self.teacher.vocab_size)
        if num_draft < 0:
            raise ValueError(f"num_draft must be >= 0, got {num_draft}")
        return self._groups(drafter, prompts, max_new_tokens, num_draft, policy, sampling)

    def _groups(self, drafter, prompts, max_new: int, num_draft: int, policy, sampling) -> BatchGeneration:
        """``_run`` over consecutive groups of at most ``max_rows`` prompts (the largest batch bucket), merged in
        input order; a group's latencies count from the start of the whole decode."""
        n = self.max_rows
        if n is None or len(prompts) <= n:
            return self._run(drafter, prompts, max_new, num_draft, policy, sampling)
        if isinstance(sampling, (list, tuple)):
            groups = [(prompts[i:i + n], sampling[i:i + n]) for i in range(0, len(prompts), n)]
        else:
            groups = [(prompts[i:i + n], sampling) for i in range(0, len(prompts), n)]
        out = BatchGeneration(generations=[])
        for group, group_sampling in groups:
            part = self._run(drafter, group, max_new, num_draft, policy, group_sampling)
            for g in part.generations:
                g.seconds += out.seconds
            out.generations += part.generations
            for name in ("seconds", "prefill_seconds", "draft_seconds", "verify_seconds", "compile_seconds", "steps"):
                setattr(out, name, getattr(out, name) + getattr(part, name))
            out.stats.merge(part.stats)
            for name in ("gamma_steps", "live_steps", "bucket_steps"):
                getattr(out, name).update(getattr(part, name))
            out.step_log += part.step_log
        return out

    # --- state and step functions ------------------------------------------------------------------------------
    def _state(self, rows: int, columns: int, key: tuple) -> BatchSteps:
        layers, max_nodes, committed, probs, max_chain = key
        state = self._states.get((rows, *key))
        if state is None or state.cache.capacity < columns:
            if self._shapes is None:
                self._shapes = kv_shapes(self.model)
            hf = {i: self.teacher.resolve_layer(i) for i in layers}
            state = BatchSteps(self.model, self.owner.layout, rows, _capacity(columns), self.teacher.vocab_size, hf,
                               max_nodes, committed, self._shapes, probs=probs, max_chain=max_chain,
                               fine=not self.owner.static_prefill)
            old = self._states.get((rows, *key))
            self._states[(rows, *key)] = state
            if old is not None:  # the steps and drafts made for the replaced buffers go with them
                self._fns = {k: f for k, f in self._fns.items() if k[0] != id(old)}
                self._drafts = {k: d for k, d in self._drafts.items() if k[0] != id(old)}
        return state

    def _row_drafts(self, drafter, state: BatchSteps, sampling: SamplingConfig) -> RowDrafts | None:
        """The drafter's capture-safe draft step at ``state``'s rows (``inference.batch_draft``), or None: the eager
        rows draft. One per (buffers, batch-1 static draft, weights), as the batch-1 decoder keeps its static drafts."""
        if not self.static_drafts:
            return None
        made = static_of(drafter, state, sampling, self.generator, self._committed)
        if made is None:
            return None
        proto, committed = made
        key = (id(state), id(proto), weights_signature(drafter))
        rows = self._drafts.get(key)
        if rows is None:
            if len(self._drafts) >= STATIC_KEPT:  # the oldest goes, with the steps made for it
                old = self._drafts.pop(next(iter(self._drafts)))
                self._fns = {k: f for k, f in self._fns.items() if k[1:3] != ("draft", id(old))}
            like = next((d for d in self._drafts.values() if d.proto is proto), None)  # another bucket's rows
            try:
                rows = self._drafts[key] = RowDrafts(drafter, proto, committed, state, like)
            except NotStackable as e:
                log.info("drafting %s through its eager rows: %s", drafter.name, e)
                return None
        return rows

    def _draft_step(self, static: RowDrafts, shape: tuple | None):
        """The rows' draft step as this decoder runs a step (compiled / recorded like the verify steps), one per
        shape the drafter chose (``inference.static_draft.ShapedDraft``)."""
        key = (id(static.state), "draft", id(static), shape)
        fn = self._fns.get(key)
        if fn is None:
            label = f"batched draft step ({type(static.proto).__name__}, {static.R} rows)"
            fn = self._fns[key] = self.owner._wrap(static.draft, label)
        return fn

    def _step(self, state: BatchSteps, bucket: Bucket, sampling: SamplingConfig) -> None:
        state.cache.bucket = bucket.columns
        if not sampling.greedy or self.typical is not None:
            torch.rand(state.uniforms.shape, generator=self.generator, device=self.device, out=state.uniforms)
        key = (id(state), bucket, sampling, self.typical)
        fn = self._fns.get(key)
        if fn is None:
            step = (functools.partial(state.plain, sampling) if bucket.nodes == 0
                    else functools.partial(state.verify, bucket, sampling, self.typical))
            label = (f"batched {'plain' if bucket.nodes == 0 else 'verify'} step ({bucket.nodes} nodes, "
                     f"{bucket.columns} columns)")
            fn = self._fns[key] = self.owner._wrap(step, label)
        fn()

    # --- the loop ----------------------------------------------------------------------------------------------
    def _run(self, drafter, prompts, max_new: int, num_draft: int, policy: Policy | None, sampling) -> BatchGeneration:
        prompts = check_batch(prompts, max_new, num_draft, self.max_positions)
        sampling = self._sampling(sampling, len(prompts))
        if drafter is not None and policy is not None and policy(len(prompts)) == 0:
            # Too large a batch to speculate from the start: decode it plainly. Keeping the drafter in step anyway
            # (target hidden states, every row's observe) costs a feature drafter 5-10% of plain throughput here, to
            # buy drafting only in the short tail once most rows have finished.
            drafter = None
        result = BatchGeneration(generations=[None] * len(prompts))
        owner = self.owner
        with owner._pinned():
            sync(self.device)
            start, compiled = time.perf_counter(), owner.compile_seconds
            batch = self._prefill(drafter, prompts, max_new, num_draft, sampling)
            sync(self.device)
            result.prefill_seconds = time.perf_counter() - start
            self._retire(batch, result, max_new, start, compiled)
            while batch.live:
                self._rebucket(batch)
                live = len(batch.live)
                gamma = 0 if batch.draft is None and batch.static is None else (
                    num_draft if policy is None else max(0, min(int(policy(live)), num_draft)))
                t0, before = time.perf_counter(), owner.compile_seconds
                bucket, drafted = self._draft(batch, gamma, max_new)
                t1, drafting = time.perf_counter(), owner.compile_seconds
                self._step(batch.state, bucket, sampling)
                self._commit(batch, bucket, drafted)
                self._retire(batch, result, max_new, start, compiled)
                sync(self.device)
                t2 = time.perf_counter()
                draft_s = t1 - t0 - (drafting - before)
                verify_s = t2 - t1 - (owner.compile_seconds - drafting)
                result.draft_seconds += draft_s
                result.verify_seconds += verify_s
                result.steps += 1
                result.gamma_steps[gamma] += 1
                result.live_steps[live] += 1
                result.bucket_steps[batch.state.R] += 1
                result.step_log.append((live, gamma, draft_s, verify_s))
        result.compile_seconds = owner.compile_seconds - compiled
        result.seconds = time.perf_counter() - start - result.compile_seconds
        for g in result.generations:
            result.stats.merge(g.stats)
        return result

    def _sampling(self, sampling, n: int) -> SamplingConfig:
        if sampling is None or isinstance(sampling, SamplingConfig):
            return sampling or self.sampling
        settings = list(sampling)
        if len(settings) != n or not all(isinstance(s, SamplingConfig) for s in settings):
            raise ValueError(f"sampling has {len(settings)} settings for {n} prompts; give one SamplingConfig for the "
                             f"whole batch")
        if len(set(settings)) > 1:
            raise ValueError(f"sampling differs between the rows of one batch ({sorted({s.describe() for s in settings})}"
                             f"); a batch decodes with one SamplingConfig: decode each setting as its own batch")
        return settings[0]

    def _prefill(self, drafter, prompts: list[Tensor], max_new: int, num_draft: int,
                 sampling: SamplingConfig) -> _Batch:
        """The prompts into a batch bucket's rows, each with its first new token, its drafter row observed on it."""
        n = len(prompts)
        P = max(p.shape[0] for p in prompts)
        width = 1 + (MAX_NODES if drafter is not None else 0)
        layers = tuple(drafter.teacher_layers) if drafter is not None else ()
        probs = drafter is not None and not sampling.greedy
        key = (layers, MAX_NODES if drafter is not None else 0, 1 + num_draft, probs, num_draft if probs else 0)
        state = self._state(batch_bucket(n), P + max_new + width + 1, key)
        logits, hidden = state.prefill(prompts)
        first = logits.argmax(-1) if sampling.greedy else sample(warp(logits, sampling), self.generator)
        state.pending.zero_()
        state.pending[:n].copy_(first)
        firsts = first.tolist()
        rows = [_Row(i, i, [firsts[i]], Generation(new_tokens=[], seconds=0.0), p.shape[0] + 1)
                for i, p in enumerate(prompts)]
        draft = seq = static = None
        if drafter is not None:
            static = self._row_drafts(drafter, state, sampling)
        if static is not None:
            static.prefill(prompts, hidden, first)
        elif drafter is not None:
            draft = drafter.rows([int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device))
                                  for _ in range(n)])
            seq = torch.zeros(n, P + max_new + width + 1, dtype=torch.long, device=self.device)
            for i, p in enumerate(prompts):
                seq[i, : p.shape[0]].copy_(p)
                draft.observe(i, {layer: h[i: i + 1, : p.shape[0]] for layer, h in hidden.items()})
            seq[torch.arange(n), torch.tensor([p.shape[0] for p in prompts])] = first.to(seq.device)
        return _Batch(state, rows, draft, seq, sampling, key, static, drafter, num_draft)

    def _draft(self, batch: _Batch, gamma: int, max_new: int) -> tuple[Bucket, list[tuple] | None]:
        """Every live row's proposal in the step's buffers: the draft step at the bucket's rows, or one call to the
        drafter's eager rows; (the step's bucket (0 nodes: a plain step), per live row (its draft's size, its
        eager tree or None))."""
        state = batch.state
        cache = state.cache
        width_of = lambda nodes: cache.use_bucket(max(cache.host_lengths[r.slot] for r in batch.live) + 1 + nodes)
        if batch.static is not None:
            return self._draft_static(batch, gamma, max_new, width_of)
        if gamma == 0 or batch.draft is None:
            return Bucket(0, True, width_of(0)), None
        depths = [min(gamma, max_new - len(r.new)) for r in batch.live]
        trees = batch.draft.propose([batch.seq[r.index: r.index + 1, : r.m] for r in batch.live], depths,
                                    [batch.sampling] * len(batch.live))
        for tree in trees:
            tree.check_shape(self.teacher.vocab_size)
        drafted = [(t.size, t) for t in trees]
        biggest = max(t.size for t in trees)
        if biggest == 0:
            return Bucket(0, True, width_of(0)), drafted
        chain = all(t.is_chain for t in trees)
        if not chain:
            N = tree_nodes(biggest)
        else:  # a drafter that cuts its chains (DSpark's confidence cut): the bucket of the longest row's chain
            N = cut_width(biggest, gamma) if getattr(batch.drafter, "variable_depth", False) else gamma
        self._check(state, trees, N, chain, batch.sampling)
        state.tokens_RT[:, :N].fill_(-1)
        if not chain:
            state.parents_RT[:, :N].fill_(-1)
        P = state.probs_RTV
        if P is not None and chain:
            P[:, :N].zero_()
        for r, t in zip(batch.live, trees):
            if not t.size:
                continue
            state.tokens_RT[r.slot, : t.size].copy_(t.tokens)
            if not chain:
                state.parents_RT[r.slot, : t.size].copy_(t.parents)
            if P is not None and chain:
                if t.probs_NV is not None:
                    P[r.slot, : t.size].copy_(t.probs_NV)
                else:  # point masses: q(x) = 1 on each drafted token
                    P[r.slot, : t.size].scatter_(1, t.tokens.view(-1, 1).clamp(0, P.shape[-1] - 1), 1.0)
        return Bucket(N, chain, width_of(N)), drafted

    def _draft_static(self, batch: _Batch, gamma: int, max_new: int, width_of) -> tuple[Bucket, list[tuple] | None]:
        """The draft step at the bucket's rows (``inference.batch_draft``), straight into the step's buffers; then,
        on the host, the rows near the end of their budget (or under a smaller γ) clipped: their nodes deeper than
        the tokens they still need get token -1, never accepted, as the batch-1 decoder clips its static drafts. A
        plain step (γ = 0) still runs the draft step: its catch-up keeps every row's draft state in step."""
        static, state = batch.static, batch.state
        shape = static.use_shape(max(state.cache.host_lengths))  # every row's context, finished ones too
        self._draft_step(static, shape)()
        if gamma == 0:
            return Bucket(0, True, width_of(0)), None
        T, chain = static.T, static.chain
        kept = static.kept_R.tolist() if static.kept_R is not None else None  # a cutting drafter: one read-back
        drafted, N = [], 0 if kept is not None else T
        for r in batch.live:
            depth = min(gamma, max_new - len(r.new))
            size = min(depth, T) if chain else T
            if kept is not None:  # the cut's bucket, filled with drafted tokens (as at batch 1)
                width = cut_width(min(kept[r.slot], size), T)
                size, N = min(size, width), max(N, width)
            if chain and size < T:
                state.tokens_RT[r.slot, size:T].fill_(-1)
                if state.probs_RTV is not None:
                    state.probs_RTV[r.slot, size:T].zero_()
            elif not chain and depth < batch.num_draft:
                clip_tree(DraftBuffers(state.tokens_RT[r.slot, :T], state.parents_RT[r.slot, :T]), depth)
            drafted.append((size, None))
        if N == 0:  # every row's cut kept nothing: a plain step (the draft step already ran its catch-up)
            return Bucket(0, True, width_of(0)), None
        return Bucket(N, chain, width_of(N)), drafted

    @staticmethod
    def _check(state: BatchSteps, trees: list[DraftTree], N: int, chain: bool, sampling: SamplingConfig) -> None:
        if N > state.max_nodes:
            raise ValueError(f"a proposal of {N} nodes per row is wider than the batched decoder's {state.max_nodes}; "
                             f"draft a smaller tree (drafter.total_tokens, decoder.tree)")
        if not chain and any(t.size and t.depth_bound is not None and t.depth_bound > state.max_depth
                             for t in trees):
            raise ValueError(f"a tree deeper than eval.num_draft={state.max_depth} levels; raise eval.num_draft or "
                             f"draft a shallower tree")
        if not chain and not sampling.greedy and any(t.probs_NV is not None for t in trees):
            raise ValueError("siblings sampled with draft probabilities are not verified by the batched decoder; "
                             "draft a chain, or point-mass (top-k) siblings")

    def _commit(self, batch: _Batch, bucket: Bucket, drafted: list[tuple] | None) -> None:
        """The step's one read-back, then each live row's counts, tokens and its eager drafter's hand-off."""
        state, N = batch.state, bucket.nodes
        values = state.out[:, : bucket.packed].tolist()
        host = state.cache.host_lengths
        for i, r in enumerate(batch.live):
            v = values[r.slot]
            count, depth_seen, flags = v[:3]
            size, tree = drafted[i] if drafted is not None else (0, None)
            if flags:
                if tree is None:  # a static draft: what the step read
                    tree = DraftTree(state.tokens_RT[r.slot, :N].cpu(), torch.arange(-1, N - 1) if bucket.chain
                                     else state.parents_RT[r.slot, :N].cpu())
                if flags & 2:
                    raise_bad_parents(tree.parents)
                raise_bad_tokens(tree.tokens, self.teacher.vocab_size)
            path, committed = v[3: 3 + count], v[3 + N: 4 + N + count]
            context = host[r.slot]
            host[r.slot] += 1 + count
            gen = r.gen
            gen.stats.update(size if bucket.chain else depth_seen, count)
            gen.verified_positions += bucket.width  # the row's share of the forward: the step's width
            if batch.static is not None or batch.draft is not None:
                gen.nodes_per_forward[size] += 1
                if size not in gen.shapes:
                    if batch.static is not None:
                        gen.shapes[size] = (torch.arange(-1, size - 1) if batch.static.chain
                                            else batch.static.parents_T[:size].clone())
                    else:
                        gen.shapes[size] = (tree.parents.cpu() if tree is not None
                                            else torch.empty(0, dtype=torch.long))
                gen.node_accepts[size].update(path)
                gen.context_tokens += context + 1
            if batch.draft is not None:
                batch.seq[r.index, r.m: r.m + 1 + count].copy_(state.out[r.slot, 3 + N: 4 + N + count])
                r.m += 1 + count
                batch.draft.observe(i, {layer: h[r.slot: r.slot + 1, : 1 + count].clone()
                                        for layer, h in state.committed_hidden.items()})
                batch.draft.accepted(i, path, committed)
            r.new.extend(committed)

    def _retire(self, batch: _Batch, result: BatchGeneration, max_new: int, start: float, compiled: float) -> None:
        """Finished rows (max_new_tokens reached, or EOS committed) leave the live rows; their slots go inactive."""
        eos = self.eos_token_id
        done = [i for i, r in enumerate(batch.live) if len(r.new) >= max_new or (eos is not None and eos in r.new)]
        if not done:
            return
        now = time.perf_counter() - start - (self.owner.compile_seconds - compiled)
        for i in done:
            r = batch.live[i]
            r.gen.new_tokens, r.gen.seconds = finish(r.new, max_new, eos), now
            result.generations[r.index] = r.gen
        slots = torch.tensor([batch.live[i].slot for i in done], dtype=torch.long, device=self.device)
        batch.state.active.index_fill_(0, slots, 0)
        keep = [i for i in range(len(batch.live)) if i not in done]
        if batch.draft is not None:
            batch.draft.keep(keep)
        batch.live = [batch.live[i] for i in keep]

    def _rebucket(self, batch: _Batch) -> None:
        """At most half the bucket live: the live rows move to the smallest bucket holding them."""
        old = batch.state
        rows = batch_bucket(len(batch.live))
        if rows == old.R:
            return
        state = self._state(rows, old.cache.capacity, batch.key)
        slots = [r.slot for r in batch.live]
        state.cache.copy_rows(old.cache, slots, max(old.cache.host_lengths[s] for s in slots))
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        state.pending.zero_()
        state.pending[: len(slots)].copy_(old.pending.index_select(0, index))
        state.active.copy_(torch.tensor([1] * len(slots) + [0] * (rows - len(slots)), dtype=torch.long))
        if batch.static is not None:  # the draft state moves with its rows, and so does what they last committed
            n = len(slots)
            state.out[:n].copy_(old.out.index_select(0, index))
            state.committed_ids[:n].copy_(old.committed_ids.index_select(0, index))
            for i, h in state.committed_hidden.items():
                h[:n].copy_(old.committed_hidden[i].index_select(0, index))
            static = self._row_drafts(batch.drafter, state, batch.sampling)
            static.move_rows(batch.static, slots)
            batch.static = static
        for j, r in enumerate(batch.live):
            r.slot = j
        batch.state = state
