"""The decoder: plain and speculative decoding of one prompt or a batch, through recorded steps
(``inference.batch_steps``) over a static cache: B sequences share one target forward per step, each accepts its own
number of tokens; batch 1 is the one-row bucket. Under a large batch the target forward is already busy, so
``inference.policy`` decides per step whether speculating still pays (``eval.batch_sweep`` runs the sweep).

Per decode: the prompts go into the rows of a batch bucket (1, 2, 4, 8, ...: the smallest holding them), right-padded,
in one forward (recorded per capacity bucket where steps are compiled or recorded, else eager over the prompts' own
columns); then per step the host
1. drafts: a drafter with a static draft (``inference.static_draft``: every kind but lookup) runs its draft step at
   the bucket's rows (``inference.batch_draft``: at one row the kind's own step, at more that step vmapped over the
   rows' stacked states), compiled or recorded like the verify steps, writing the step's draft buffers on the device;
   rows near the end of their budget get token -1 past the tokens they still need, and a drafter that cuts its own
   chains (DSpark's confidence cut) is verified in the bucket of the longest row's cut (one read-back of every row's
   kept count). Lookup, and a draft the verify cannot take (siblings sampled with draft probabilities), propose
   through per-row copies of the drafter (``drafter.rows(seeds)``), each row's chain or tree copied into the step's
   buffers, padded with token -1. A plain step (γ = 0 from the policy)
   verifies nothing drafted; a static draft step still runs before it, keeping the rows' draft state in step;
2. fills the sampling draws (one ``torch.rand`` into a static buffer: a replayed step draws nothing itself);
3. runs the step of the bucket (batch bucket, width, chain or tree, capacity bucket) as ``inference.runner`` runs
   it: eager, compiled (once per step kind: its capacity buckets share the compilation) or a CUDA graph replay;
4. reads every row's packed verdict back at once, and does the host's bookkeeping (committed tokens, EOS, the
   drafter's ``observe`` / ``accepted``).
A finished row (``max_new_tokens`` or EOS) stays in its bucket, inactive, until at most half the bucket is live: the
live rows then move to the smallest bucket holding them (their cache rows and draft state rows copied once). Every
row is lossless: greedy rows are token-identical to plain greedy decoding, sampled rows are distributed as the target.

Shapes: B prompts, R rows of the batch bucket, N draft nodes per row, V vocabulary.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.batch_draft import NotStackable, RowDrafts, static_of
from inference.batch_cache import capacity_of, kv_shapes
from inference.batch_steps import BatchSteps, Bucket, cut_width, tree_nodes
from inference.generation import (BatchGeneration, Generation, batch_bucket, check_batch, check_vocab, finish,
                                  one_sampling, sync)
from inference.masks import AttentionLayout
from inference.proposer import Proposer, ProposerRows
from inference.runner import StepClock, StepRunner
from inference.sampling import GREEDY, SamplingConfig, sample, warp
from inference.static_draft import DraftBuffers, clip_tree, weights_signature
from inference.tree import DraftTree, raise_bad_parents, raise_bad_tokens

log = logging.getLogger(__name__)

MAX_NODES = 64  # the widest draft the fixed buffers hold (a larger tree is refused with the fix)
STATIC_KEPT = 16  # static drafts (and their steps) a decoder keeps at one row, and 16 at more; oldest dropped first

Policy = Callable[[int], int]  # live batch size -> draft tokens (γ) for this step; 0 = a plain step


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
    draft: ProposerRows | None  # per-row copies (a drafter without a static draft here)
    seq: Tensor | None  # [B, prompt + new + room]: each prompt's committed tokens (eager drafting only)
    sampling: SamplingConfig
    key: tuple  # the state's shape apart from its batch bucket
    static: RowDrafts | None = None  # the capture-safe draft step at the bucket's rows
    drafter: Proposer | None = None
    num_draft: int = 0


class BucketDecoder:
    """Decodes prompts (one, or a batch) with a frozen target (a ``distill.teacher.Teacher``) and, optionally, a
    drafter: batch 1 is the one-row bucket. ``runner``: how the steps run (``inference.runner.StepRunner``: CUDA
    graphs, compile) and the generator they draw from (None: a new one, on ``generator`` or one seeded with
    ``seed``, with ``cuda_graphs`` / ``compile`` / ``compile_backend``). A drafter drafts through its static draft
    step at the bucket's rows (``inference.batch_draft``) wherever it has one; else through per-row copies of its
    eager ``propose`` (``heads.base.ForkedRows``: lookup, a draft the verify cannot take)."""

    def __init__(self, teacher, eos_token_id: int | None = None, sampling: SamplingConfig = GREEDY, seed: int = 0,
                 generator: torch.Generator | None = None, cuda_graphs: str = "auto", compile: str | bool = "auto",
                 compile_backend: str | None = None, runner: StepRunner | None = None,
                 typical: tuple[float, float] | None = None, max_rows: int | None = None):
        self.teacher = teacher
        self.model = teacher.model
        self.device = teacher.device
        self.eos_token_id = eos_token_id
        self.sampling = sampling
        self.max_positions = teacher.max_positions
        self.layout = AttentionLayout.of(self.model)
        if runner is None:
            generator = generator or torch.Generator(device=self.device).manual_seed(seed)
            runner = StepRunner(self.device, generator, cuda_graphs=cuda_graphs, compile=compile,
                                compile_backend=compile_backend)
        self.runner = runner
        self.typical = typical  # (threshold, alpha) of Medusa's typical acceptance (LOSSY), or None: the exact rule
        if max_rows is not None and (max_rows < 1 or max_rows & (max_rows - 1)):
            raise ValueError(f"decoder.max_batch_rows={max_rows}: the largest batch bucket must be a power of two "
                             f">= 1 (1, 2, 4, 8, ...), or null for no cap")
        self.max_rows = max_rows  # the largest batch bucket; more prompts are decoded in consecutive groups of it
        self.generator = runner.generator
        self._shapes = None
        self._states: dict[tuple, BatchSteps] = {}
        self._fns: dict[tuple, object] = {}  # keyed by (id(state), ...): dropped with the buffers they read
        self._drafts: dict[tuple, RowDrafts] = {}  # (id(state), id(batch-1 draft), weights) -> its rows
        self._committed: dict[tuple, object] = {}  # shape -> the batch-1 committed buffers static drafts are made for

    # how the steps ran so far (``StepRunner``'s figures)
    compile = property(lambda self: self.runner.compile)
    graphs = property(lambda self: self.runner.graphs)
    fallback_reason = property(lambda self: self.runner.fallback_reason)
    compile_seconds = property(lambda self: self.runner.compile_seconds)

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def describe(self) -> dict:
        """How the steps ran (``StepRunner.describe``)."""
        return self.runner.describe(self._fns.values())

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
            out.extend(self._run(drafter, group, max_new, num_draft, policy, group_sampling))
        return out

    # --- state and step functions ------------------------------------------------------------------------------
    def _state(self, rows: int, columns: int, key: tuple) -> BatchSteps:
        layers, max_nodes, committed, probs, max_chain = key
        state = self._states.get((rows, *key))
        if state is None or state.cache.capacity < columns:
            if self._shapes is None:
                self._shapes = kv_shapes(self.model)
            hf = {i: self.teacher.resolve_layer(i) for i in layers}
            state = BatchSteps(self.model, self.layout, rows, capacity_of(columns), self.teacher.vocab_size, hf,
                               max_nodes, committed, self._shapes, probs=probs, max_chain=max_chain,
                               fine=not self.runner.static_prefill)
            old = self._states.get((rows, *key))
            self._states[(rows, *key)] = state
            if old is not None:  # the steps and drafts made for the replaced buffers go with them
                self._fns = {k: f for k, f in self._fns.items() if k[0] != id(old)}
                self._drafts = {k: d for k, d in self._drafts.items() if k[0] != id(old)}
                self.runner.forget({id(s) for s in self._states.values()})
        return state

    def _row_drafts(self, drafter, state: BatchSteps, sampling: SamplingConfig) -> RowDrafts | None:
        """The drafter's capture-safe draft step at ``state``'s rows (``inference.batch_draft``), or None: per-row
        copies draft. One per (buffers, batch-1 static draft, weights)."""
        made = static_of(drafter, state, sampling, self.generator, self._committed)
        if made is None:
            return None
        proto, committed = made
        key = (id(state), id(proto), weights_signature(drafter))
        rows = self._drafts.get(key)
        if rows is None:
            alike = [k for k, d in self._drafts.items() if (d.R == 1) == (state.R == 1)]
            if len(alike) >= STATIC_KEPT:  # the oldest of its kind goes, with the steps made for it
                old = self._drafts.pop(alike[0])
                self._fns = {k: f for k, f in self._fns.items() if k[1:3] != ("draft", id(old))}
            like = next((d for d in self._drafts.values() if d.proto is proto), None)  # another bucket's rows
            try:
                rows = self._drafts[key] = RowDrafts(drafter, proto, committed, state, like)
            except NotStackable as e:
                log.info("drafting %s through per-row copies: %s", drafter.name, e)
                return None
        return rows

    def _draft_step(self, static: RowDrafts, shape: tuple | None):
        """The rows' draft step as this decoder runs a step (compiled / recorded like the verify steps), one per
        shape the drafter chose (``inference.static_draft.ShapedDraft``)."""
        key = (id(static.state), "draft", id(static), shape)
        fn = self._fns.get(key)
        if fn is None:
            label = f"batched draft step ({type(static.proto).__name__}, {static.R} rows)"
            fn = self._fns[key] = self.runner.wrap(static.draft, label)
        return fn

    def _step(self, state: BatchSteps, bucket: Bucket, sampling: SamplingConfig) -> None:
        state.cache.bucket = bucket.columns
        if not sampling.greedy or self.typical is not None:
            torch.rand(state.uniforms.shape, generator=self.generator, device=self.device, out=state.uniforms)
        key = (id(state), bucket, sampling, self.typical)
        fn = self._fns.get(key)
        if fn is None:
            # A step reads its key columns from the cache (``BatchKV.bucket``), never from ``bucket.columns``: the
            # step of one kind is the same function, compiled once, at every capacity bucket.
            shape = Bucket(bucket.nodes, bucket.chain, 0)
            step = (functools.partial(state.plain, sampling) if bucket.nodes == 0
                    else functools.partial(state.verify, shape, sampling, self.typical))
            label = (f"{'plain' if bucket.nodes == 0 else 'verify'} step ({state.R} rows, {bucket.nodes}-node "
                     f"{'chain' if bucket.chain else 'tree'})")
            fn = self._fns[key] = self.runner.wrap(step, label, (id(state), shape, sampling, self.typical))
        fn()

    # --- the loop ----------------------------------------------------------------------------------------------
    def _run(self, drafter, prompts, max_new: int, num_draft: int, policy: Policy | None, sampling) -> BatchGeneration:
        prompts = check_batch(prompts, max_new, num_draft, self.max_positions)
        sampling = one_sampling(sampling, len(prompts), self.sampling)
        if drafter is not None and policy is not None and policy(len(prompts)) == 0:
            # Too large a batch to speculate from the start: decode it plainly. Keeping the drafter in step anyway
            # (target hidden states, every row's observe) costs a feature drafter 5-10% of plain throughput here, to
            # buy drafting only in the short tail once most rows have finished.
            drafter = None
        result = BatchGeneration(generations=[None] * len(prompts))
        runner = self.runner
        with runner.pinned():
            sync(self.device)
            start, compiled = time.perf_counter(), runner.compile_seconds
            batch = self._prefill(drafter, prompts, max_new, num_draft, sampling)
            sync(self.device)
            result.prefill_seconds = time.perf_counter() - start
            prefilled = runner.compile_seconds
            self._retire(batch, result, max_new, start, compiled)
            clock, shapes = StepClock(self.device), []
            while batch.live:
                self._rebucket(batch)
                live = len(batch.live)
                gamma = 0 if batch.draft is None and batch.static is None else (
                    num_draft if policy is None else max(0, min(int(policy(live)), num_draft)))
                t0, before = clock.mark(), runner.compile_seconds
                bucket, drafted = self._draft(batch, gamma, max_new)
                t1, drafting = clock.mark(), runner.compile_seconds
                self._step(batch.state, bucket, sampling)
                self._commit(batch, bucket, drafted)
                clock.step(t0, t1, clock.mark())
                shapes.append((live, gamma, batch.state.R, drafting - before, runner.compile_seconds - drafting))
                self._retire(batch, result, max_new, start, compiled)
            sync(self.device)
        result.prefill_seconds -= prefilled - compiled
        for (live, gamma, R, draft_c, verify_c), (draft_s, verify_s) in zip(shapes, clock.steps()):
            draft_s, verify_s = max(draft_s - draft_c, 0.0), max(verify_s - verify_c, 0.0)
            result.draft_seconds += draft_s
            result.verify_seconds += verify_s
            result.steps += 1
            result.gamma_steps[gamma] += 1
            result.live_steps[live] += 1
            result.bucket_steps[R] += 1
            result.step_log.append((live, gamma, draft_s, verify_s))
        result.compile_seconds = runner.compile_seconds - compiled
        result.seconds = time.perf_counter() - start - result.compile_seconds
        for g in result.generations:
            result.stats.merge(g.stats)
        return result

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
        logits, hidden = self._prefill_state(state, prompts)
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

    def _prefill_state(self, state: BatchSteps, prompts: list[Tensor]) -> tuple[Tensor, dict[int, Tensor]]:
        """The prompts into ``state``'s cache: (each prompt's last logits [n, V], hidden states {layer: [R, P, D]}).
        Recorded or compiled like a step, one per capacity bucket, where steps are (graphs, compile); else eager over
        the prompts' own columns (on a CPU, attention over a whole bucket would cost more than it saves)."""
        if not self.runner.static_prefill:
            return state.prefill(prompts)
        B = state.load_prompts([p.to(self.device) for p in prompts])
        key = (id(state), "prefill", B)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self.runner.wrap(functools.partial(state.prefill_bucket, B),
                                                   f"prefill ({state.R} rows, {B} columns)")
        fn()
        n = len(prompts)
        return state.first_logits[:n].clone(), {i: h.clone() for i, h in state.prefill_hidden[B].items()}

    def _draft(self, batch: _Batch, gamma: int, max_new: int) -> tuple[Bucket, list[tuple] | None]:
        """Every live row's proposal in the step's buffers: the draft step at the bucket's rows, or one call to the
        drafter's per-row copies; (the step's bucket (0 nodes: a plain step), per live row (its draft's size, its
        eager tree or None))."""
        width_of = self._width_of(batch)
        if batch.static is not None:
            return self._draft_static(batch, gamma, max_new, width_of)
        if gamma == 0 or batch.draft is None:
            return Bucket(0, True, width_of(0)), None
        depths = [min(gamma, max_new - len(r.new)) for r in batch.live]
        trees = batch.draft.propose([batch.seq[r.index: r.index + 1, : r.m] for r in batch.live], depths,
                                    [batch.sampling] * len(batch.live))
        return self._load(batch, trees, gamma, width_of)

    @staticmethod
    def _width_of(batch: _Batch) -> Callable[[int], int]:
        """nodes -> the capacity bucket a step verifying that many draft nodes reads (chosen here, on the host): the
        live rows' longest context, the pending token and the nodes."""
        cache = batch.state.cache
        return lambda nodes: cache.use_bucket(max(cache.host_lengths[r.slot] for r in batch.live) + 1 + nodes)

    def _load(self, batch: _Batch, trees: list[DraftTree], gamma: int, width_of) -> tuple[Bucket, list[tuple]]:
        """Every live row's eager proposal copied into the step's fixed buffers, padded with token -1: (the step's
        bucket, per live row (its draft's size, its tree))."""
        state = batch.state
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
        state.load_trees([r.slot for r in batch.live], trees, N, chain, batch.sampling)
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

    def _commit(self, batch: _Batch, bucket: Bucket, drafted: list[tuple] | None) -> list[tuple]:
        """The step's one read-back, then each live row's counts, tokens and its eager drafter's hand-off; per live
        row (accepted path, committed tokens)."""
        state, N = batch.state, bucket.nodes
        values = state.out[:, : bucket.packed].tolist()
        host = state.cache.host_lengths
        verdicts = []
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
                    if tree is not None:
                        gen.shapes[size] = tree.parents[:size].cpu()
                    elif batch.static is not None:
                        gen.shapes[size] = (torch.arange(-1, size - 1) if batch.static.chain
                                            else batch.static.parents_T[:size].clone())
                    else:
                        gen.shapes[size] = torch.empty(0, dtype=torch.long)
                gen.node_accepts[size].update(path)
                gen.context_tokens += context + 1
            if batch.draft is not None:
                batch.seq[r.index, r.m: r.m + 1 + count].copy_(state.out[r.slot, 3 + N: 4 + N + count])
                r.m += 1 + count
                batch.draft.observe(i, {layer: h[r.slot: r.slot + 1, : 1 + count].clone()
                                        for layer, h in state.committed_hidden.items()})
                batch.draft.accepted(i, path, committed)
            r.new.extend(committed)
            verdicts.append((path, committed))
        return verdicts

    def _retire(self, batch: _Batch, result: BatchGeneration, max_new: int, start: float, compiled: float) -> None:
        """Finished rows (max_new_tokens reached, or EOS committed) leave the live rows; their slots go inactive."""
        eos = self.eos_token_id
        done = [i for i, r in enumerate(batch.live) if len(r.new) >= max_new or (eos is not None and eos in r.new)]
        if not done:
            return
        now = time.perf_counter() - start - (self.runner.compile_seconds - compiled)
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
