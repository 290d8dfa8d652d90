"""Batched decoding, plain and speculative: B sequences share one target forward per step, each accepts its own
number of tokens.

Why: speculation buys single-stream latency with spare compute. Under a large batch the target forward is already
busy, so the wider verification block competes with other sequences' tokens; ``inference.policy`` decides per step
whether speculating still pays. This module is the mechanism; the sweep is ``eval.batch_sweep``.

The ragged KV cache. B live rows share one ``inference.kv_cache.PreallocatedCache`` of S columns ([B, heads, S,
head_dim] per layer, appended in place) and a bool ``valid_BS``: column s of row b holds one of row b's committed tokens. Rows differ in which
columns are valid, never in S, and the model's own forward runs with
- position ids per row: row b's pending token sits at position ``pos[b]`` (its count of cached real tokens), a draft
  node at ``pos[b] + depth``, so every row's RoPE positions are exactly what batch-1 decoding gives it;
- a 4D additive mask [B, 1, n, S + n]: each new token sees its row's valid columns and, in the new block, itself and
  its ancestors (a chain: the tokens before it; a tree: its ``DraftTree.geometry``, built on the device).
Prompts are left-padded (the padding columns are invalid). A step appends n = 1 + (largest proposal) columns; row b
keeps the pending token's column and its accepted nodes' columns, everything else becomes a *hole* (an invalid
column). Key order is irrelevant to attention once the mask decides visibility, so a tree's accepted path needs no
gather. Trailing columns no row kept are cropped at once (``Cache.crop(-n)``); when holes exceed
``compact_slack - 1`` of the longest row, one gather right-aligns every row's valid columns inside the buffers
(compaction, ``PreallocatedCache.gather_columns``), bounding the waste. A batch of one (batch-1 decoding) never has
holes: its accepted nodes' entries are moved up behind the pending token at once (``PreallocatedCache.keep_tail``,
only the path's columns are copied), so its cache stays exactly what plain decoding would have built. Finished rows
(``max_new_tokens`` or EOS) leave the batch (``Cache.batch_select_indices``).
Holes need whole layers (a rolling window layer would count holes toward its window): every layer, sliding
ones included, keeps its whole row, and sliding-window layers get their own mask (``inference.masks``) in which a key
is visible only within the window of the query's position; a row's valid columns hold its positions 0, 1, ... in
column order, so a column's position is its rank among the row's valid columns.

Drafting is one call for the whole batch: ``drafter.rows(seeds)`` holds every row's drafter state
(``inference.proposer.ProposerRows``); EAGLE drafts all rows in one drafter forward per tree level over a ragged
context cache (``heads.eagle_decode``), a draft model all rows in one forward per draft step over a ragged cache of
its own (``heads.draft_model_rows``), DFlash and P-EAGLE every row's whole draft in one forward
(``heads.dflash_rows``, ``heads.peagle_rows``), drafters without a batched path loop over per-row copies that share
the weights (``heads.base.ForkedRows``). Verification is batched; acceptance (``inference.acceptance.decide``, the
batch-1 decoder's rule) runs per row on that row's logits, on the device; every row's verdict is read back in one
transfer per step. Each row is decoded losslessly: greedy rows are token-identical to batch-1 greedy
decoding, sampled rows are distributed as the target (tests/test_batched.py). Rows may differ in sampling settings.

Shapes: B live rows, S cache columns, n tokens fed per row this step, V vocabulary.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference.acceptance import TYPICAL_ALPHA, TYPICAL_THRESHOLD, Verdict, verdicts
from inference.generation import (ACCEPTANCE_RULES, Generation, cache_kwarg, check_prompt, check_vocab, finish,
                                  prefill_kwargs, sync)
from inference.kv_cache import TREE_HEADROOM, PreallocatedCache
from inference.masks import AttentionLayout
from inference.proposer import Proposer, ProposerRows
from inference.sampling import GREEDY, SamplingConfig, sample, warp
from inference.stats import AcceptStats
from inference.tree import DraftTree

PAD_ID = 0  # fed in padding slots; always masked, so any id would do
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


@dataclass
class BatchGeneration:
    """One batched decode. ``generations[i]`` is prompt i's (input order); its ``seconds`` is the time from the start
    of the batch to that sequence leaving it (its latency)."""

    generations: list[Generation]
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    steps: int = 0
    stats: AcceptStats = field(default_factory=AcceptStats)
    gamma_steps: Counter = field(default_factory=Counter)  # γ chosen -> steps
    live_steps: Counter = field(default_factory=Counter)  # live batch size -> steps
    max_columns: int = 0  # widest the cache got (holes included)
    compactions: int = 0
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
class _Rows:
    """The live rows of a batch (row order = cache batch order)."""

    ids: list[int]  # prompt index of each row
    tokens: list[Tensor]  # [1, m]: prompt + committed tokens (what a drafter proposes from)
    new: list[list[int]]  # committed new tokens
    pos: list[int]  # position of the pending token = real tokens cached
    sampling: list[SamplingConfig]
    draft: ProposerRows | None  # every row's drafter state; None in plain decoding
    gens: list[Generation]  # per row: its acceptance counts and proposal shapes so far (tokens and time: at the end)
    valid: Tensor  # [B, S] bool
    cache: PreallocatedCache

    def keep(self, rows: list[int]) -> None:
        for name in ("ids", "tokens", "new", "pos", "sampling", "gens"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in rows])
        if self.draft is not None:
            self.draft.keep(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid.index_select(0, index)
        self.cache.batch_select_indices(index)

    def mark(self) -> tuple:
        """What a verification step changes, except the drafter state and the cache's contents past its length:
        ``rewind`` puts it back (the cost model times one step many times over the same context)."""
        return ([t for t in self.tokens], [list(n) for n in self.new], list(self.pos), self.valid,
                self.cache.get_seq_length())

    def rewind(self, mark: tuple) -> None:
        tokens, new, pos, self.valid, length = mark
        self.tokens, self.new, self.pos = list(tokens), [list(n) for n in new], list(pos)
        if self.cache.get_seq_length() > length:
            self.cache.crop(length - self.cache.get_seq_length())


class BatchedDecoder:
    """Decodes a batch of prompts with a frozen target (a ``distill.teacher.Teacher``) and, optionally, a drafter."""

    def __init__(self, teacher, eos_token_id: int | None = None, sampling: SamplingConfig = GREEDY, seed: int = 0,
                 compact_slack: float = 1.5, acceptance: str = "exact", typical_threshold: float = TYPICAL_THRESHOLD,
                 typical_alpha: float = TYPICAL_ALPHA, compile: bool = False, generator: torch.Generator | None = None):
        """``generator``: share the caller's random stream (``Decoder`` decodes a batch of one through this loop on
        its own generator); None: a new one seeded with ``seed``."""
        if compact_slack < 1:
            raise ValueError(f"compact_slack must be >= 1 (cache columns per valid column before compaction), "
                             f"got {compact_slack}")
        if acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"decoder.acceptance={acceptance!r}; valid: {list(ACCEPTANCE_RULES)} (typical is lossy)")
        self.teacher = teacher
        self.model = teacher.model
        self.eos_token_id = eos_token_id
        self.sampling = sampling
        self.compact_slack = compact_slack
        # (threshold, alpha) of Medusa's typical acceptance (lossy), or None: the exact rule (lossless)
        self.typical = (typical_threshold, typical_alpha) if acceptance == "typical" else None
        self.device = teacher.device
        self.generator = generator or torch.Generator(device=self.device).manual_seed(seed)
        self.mask_dtype = next(self.model.parameters()).dtype
        self.max_positions = teacher.max_positions
        self.layout = AttentionLayout.of(self.model)
        self._empty = DraftTree.empty(self.device)  # a plain step's "proposal", shared by every row (never mutated)
        # The prefill needs logits at each row's last column only (left padding: every row ends there).
        self._prefill_kw = prefill_kwargs(self.model)
        self._cache_kw = cache_kwarg(self.model)  # ``cache`` or (older transformers) ``past_key_values``
        self._target = self.model  # what ``_forward`` calls: the model, or its compiled forward (DecoderConfig.compile)
        if compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._target = torch.compile(self.model.forward, dynamic=True, mode=mode)

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def plain(self, prompts: Sequence, max_new_tokens: int, sampling=None) -> BatchGeneration:
        """Autoregressive decoding of every prompt: one batched target forward per token."""
        return self._run(None, prompts, max_new_tokens, 0, None, sampling)

    @torch.no_grad()
    def speculative(self, drafter: Proposer, prompts: Sequence, max_new_tokens: int, num_draft: int, policy: Policy | None = None,
                    sampling=None) -> BatchGeneration:
        """Speculative decoding of every prompt; lossless per row. ``policy(live rows) -> γ`` picks each step's draft
        length (0: a plain step); None drafts ``num_draft`` every step. ``sampling``: one ``SamplingConfig`` for all
        rows, a list with one per prompt (mixed settings), or None for the decoder's."""
        check_vocab(drafter, self.teacher.vocab_size)
        if num_draft < 0:
            raise ValueError(f"num_draft must be >= 0, got {num_draft}")
        return self._run(drafter, prompts, max_new_tokens, num_draft, policy, sampling)

    # --- the loop ---------------------------------------------------------------------------------------------
    def _run(self, drafter, prompts, max_new: int, num_draft: int, policy: Policy | None, sampling) -> BatchGeneration:
        prompts = check_batch(prompts, max_new, num_draft, self.max_positions)
        samplings = self._samplings(sampling, len(prompts))
        if drafter is not None and policy is not None and policy(len(prompts)) == 0:
            # Too large a batch to speculate from the start: decode it plainly. Keeping the drafter in step anyway
            # (target hidden states, every row's observe) costs a feature drafter 5-10% of plain throughput here, to
            # buy drafting only in the short tail once most rows have finished.
            drafter = None
        layers = tuple(drafter.teacher_layers) if drafter is not None else ()
        result = BatchGeneration(generations=[None] * len(prompts))
        sync(self.device)
        start = time.perf_counter()
        rows, _ = self._prefill(prompts, samplings, drafter, layers, max_new)
        sync(self.device)
        result.prefill_seconds = time.perf_counter() - start
        self._retire(rows, result, max_new, start)
        while rows.ids:
            live = len(rows.ids)
            gamma = num_draft if policy is None else max(0, min(int(policy(live)), num_draft))
            gamma = 0 if drafter is None else gamma
            t0 = time.perf_counter()
            trees = self._draft(rows, gamma, max_new)
            sync(self.device)
            t1 = time.perf_counter()
            results, hidden = self._verify(rows, trees, layers)
            self._commit(rows, trees, results, hidden)
            result.max_columns = max(result.max_columns, rows.valid.shape[1])
            self._retire(rows, result, max_new, start)
            result.compactions += self._maybe_compact(rows)
            sync(self.device)
            t2 = time.perf_counter()
            result.draft_seconds += t1 - t0
            result.verify_seconds += t2 - t1
            result.steps += 1
            result.gamma_steps[gamma] += 1
            result.live_steps[live] += 1
            result.step_log.append((live, gamma, t1 - t0, t2 - t1))
        result.seconds = time.perf_counter() - start
        for g in result.generations:
            result.stats.merge(g.stats)
        return result

    def _samplings(self, sampling, n: int) -> list[SamplingConfig]:
        if sampling is None or isinstance(sampling, SamplingConfig):
            return [sampling or self.sampling] * n
        sampling = list(sampling)
        if len(sampling) != n or not all(isinstance(s, SamplingConfig) for s in sampling):
            raise ValueError(f"sampling has {len(sampling)} settings for {n} prompts; give one SamplingConfig per "
                             f"prompt, or a single one for the whole batch")
        return sampling

    def _new_cache(self, capacity: int) -> PreallocatedCache:
        """Room for ``capacity`` columns per row, appended in place (``inference.kv_cache``; it grows if holes
        need more); plain layers only: see the module docstring."""
        return self.layout.new_cache(capacity=capacity)

    def _forward(self, ids_BN: Tensor, pos_BN: Tensor, mask: Tensor, cache: PreallocatedCache, layers: tuple[int, ...],
                 **kw):
        out = self._target(input_ids=ids_BN, position_ids=pos_BN, attention_mask=mask, use_cache=True,
                           output_hidden_states=bool(layers), **{self._cache_kw: cache}, **kw)
        hidden = {i: out.hidden_states[self.teacher.resolve_layer(i)] for i in layers}
        return out.logits, hidden  # [B, n, V], {layer: [B, n, D]}

    def _mask(self, valid_BS: Tensor, block_BNN: Tensor, pos_BN: Tensor) -> Tensor | dict[str, Tensor]:
        """[B, 1, n, S + n] additive (per layer type, ``inference.masks``): a new token at ``pos_BN`` sees its row's
        valid past columns and what ``block`` allows; sliding layers only those within their window."""
        B, n = block_BNN.shape[:2]
        allowed = torch.cat([valid_BS[:, None, :].expand(B, n, valid_BS.shape[1]), block_BNN], dim=2)
        k_pos = torch.cat([valid_BS.long().cumsum(1) - 1, pos_BN], dim=1)  # a valid column's rank = its position
        return self.layout.additive(allowed, pos_BN, k_pos, self.mask_dtype)

    def _next_token(self, logits_V: Tensor, sampling: SamplingConfig) -> Tensor:
        if sampling.greedy:
            return logits_V.argmax(-1, keepdim=True)
        return sample(warp(logits_V[None], sampling), self.generator)

    def _prefill(self, prompts: list[Tensor], samplings: list[SamplingConfig], drafter, layers,
                 max_new: int) -> tuple[_Rows, dict]:
        """The rows after one batched prompt forward (each with its first new token, its drafter state observed on its
        prompt), and that forward's hidden states ({layer: [B, P, D]}, left-padded; ``inference.cost`` reuses them)."""
        B, P = len(prompts), max(p.shape[0] for p in prompts)
        ids = torch.full((B, P), PAD_ID, dtype=torch.long, device=self.device)
        valid = torch.zeros(B, P, dtype=torch.bool, device=self.device)
        for b, p in enumerate(prompts):  # left padding: every row's last column is its last prompt token
            ids[b, P - p.shape[0]:] = p.to(self.device)
            valid[b, P - p.shape[0]:] = True
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()
        block = (causal & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=self.device)  # padding sees itself
        draft = None
        if drafter is not None:
            draft = drafter.rows([int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device))
                                  for _ in range(B)])
        cache = self._new_cache(P + max_new + TREE_HEADROOM)
        logits, hidden = self._forward(ids, pos, self._mask(valid[:, :0], block, pos), cache, layers, **self._prefill_kw)
        rows = _Rows(ids=list(range(B)), tokens=[], new=[], pos=[p.shape[0] for p in prompts], sampling=samplings,
                     draft=draft, gens=[Generation(new_tokens=[], seconds=0.0) for _ in range(B)], valid=valid,
                     cache=cache)
        for b, p in enumerate(prompts):
            nxt = self._next_token(logits[b, -1], samplings[b])
            rows.tokens.append(torch.cat([p.to(self.device), nxt]).view(1, -1))
            rows.new.append([int(nxt)])
            if draft is not None:
                draft.observe(b, {i: h[b:b + 1, P - p.shape[0]:] for i, h in hidden.items()})
        return rows, hidden

    def _draft(self, rows: _Rows, gamma: int, max_new: int) -> list[DraftTree]:
        """Every row's proposal, from one call to the drafter's batch state (a plain step: none)."""
        if gamma == 0 or rows.draft is None:
            return [self._empty] * len(rows.ids)
        depths = [min(gamma, max_new - len(new)) for new in rows.new]
        trees = rows.draft.propose(rows.tokens, depths, rows.sampling)
        for tree in trees:
            tree.check_shape(self.teacher.vocab_size)  # values: with the verdict (acceptance.settle)
        return trees

    def _verify(self, rows: _Rows, trees: list[DraftTree], layers) -> tuple[list[Verdict], dict]:
        """One target forward over every row's [pending, nodes...]; per-row acceptance on the device, read back once
        for the whole batch; holes for what was rejected. Returns per row its verdict and the forward's hidden states."""
        B, n = len(trees), 1 + max(t.size for t in trees)
        dev, vocab = self.device, self.teacher.vocab_size
        # Per row: the pending token (its last committed one), its nodes (clamped: settle reports a bad one), padding.
        ids = torch.full((B, n), PAD_ID, dtype=torch.long, device=dev)
        ids[:, 0] = torch.cat([t[0, -1:] for t in rows.tokens])
        offsets = torch.arange(n, device=dev).expand(B, n).clone()  # chains: depth = index
        chains = all(t.is_chain for t in trees)
        block = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(B, n, n)
        if not chains:
            block = torch.eye(n, dtype=torch.bool, device=dev).repeat(B, 1, 1)  # padding slots see only themselves
            block[:, :, 0].fill_(True)
        for b, t in enumerate(trees):
            if t.size:
                ids[b, 1:1 + t.size] = t.tokens.clamp(0, vocab - 1)
            if not chains and t.size:
                depth_N, ancestors_NN = t.geometry
                offsets[b, 1:1 + t.size] = depth_N
                block[b, 1:1 + t.size, 1:1 + t.size] = ancestors_NN
        if not chains:  # padding slots see only themselves (column 0 is the pending token)
            block[:, 1:, 0] &= torch.cat([torch.arange(1, n, device=dev)[None] <= t.size for t in trees])
        pos = rows.valid.sum(1, keepdim=True) + offsets  # a row's valid columns are its cached tokens: its position
        logits, hidden = self._forward(ids, pos, self._mask(rows.valid, block, pos), rows.cache, layers)
        results = verdicts(trees, logits, rows.sampling, self.generator, vocab, self.typical)
        used = 1 + max(1 + max(v.path) if v.path else 0 for v in results)  # the last column any row kept, + 1
        if used < n:  # columns past the last one any row kept are dropped now
            rows.cache.crop(-(n - used))
        if B == 1:
            # One row has no ragged neighbours to stay aligned with: its accepted nodes' entries move up behind the
            # pending token now (len(path) columns per layer, inside the buffers) instead of leaving holes that every
            # later forward attends over until a compaction gathers the whole cache. A prefix path is already dense.
            path = results[0].path
            if path != list(range(len(path))):
                rows.cache.keep_tail(rows.valid.shape[1] + 1, results[0].path_index[: len(path)])
            keep = torch.ones(1, 1 + len(path), dtype=torch.bool, device=dev)
        else:
            keep = torch.zeros(B, used, dtype=torch.bool, device=dev)  # the pending token and the accepted nodes
            keep[:, 0].fill_(True)
            for b, v in enumerate(results):
                if v.path:
                    keep[b].index_fill_(0, 1 + v.path_index[: len(v.path)], True)
        rows.valid = torch.cat([rows.valid, keep], dim=1)
        return results, hidden

    def _commit(self, rows: _Rows, trees: list[DraftTree], results: list[Verdict], hidden: dict) -> None:
        """The one hand-off after a verification: each row's counts, its drafter's ``observe`` (the pending token's
        and the accepted nodes' hidden states, in path order) and ``accepted`` (the path), its committed tokens."""
        for b, (tree, v) in enumerate(zip(trees, results)):
            gen = rows.gens[b]
            gen.stats.update(v.depth, len(v.path))
            if rows.draft is not None:
                gen.nodes_per_forward[tree.size] += 1
                if tree.size not in gen.shapes:
                    gen.shapes[tree.size] = tree.parents.cpu()
                gen.node_accepts[tree.size].update(v.path)
                gen.context_tokens += rows.pos[b] + 1
                keep = torch.cat([v.path_index.new_zeros(1), 1 + v.path_index[: len(v.path)]])
                rows.draft.observe(b, {i: h[b:b + 1].index_select(1, keep) for i, h in hidden.items()})
                rows.draft.accepted(b, v.path, v.committed)
            rows.tokens[b] = torch.cat([rows.tokens[b], v.committed_ids.view(1, -1).to(self.device)], dim=1)
            rows.new[b].extend(v.committed)
            rows.pos[b] += 1 + len(v.path)

    def _retire(self, rows: _Rows, result: BatchGeneration, max_new: int, start: float) -> None:
        """Finished rows (max_new_tokens reached, or EOS committed) leave the batch and its cache."""
        eos = self.eos_token_id
        done = [b for b, new in enumerate(rows.new) if len(new) >= max_new or (eos is not None and eos in new)]
        if not done:
            return
        now = time.perf_counter() - start
        for b in done:
            gen = rows.gens[b]
            gen.new_tokens, gen.seconds = finish(rows.new[b], max_new, self.eos_token_id), now
            result.generations[rows.ids[b]] = gen
        rows.keep([b for b in range(len(rows.ids)) if b not in done])

    def _maybe_compact(self, rows: _Rows) -> int:
        """Right-align every row's valid columns when holes cost more than ``compact_slack`` allows (1 if done)."""
        if not rows.ids:
            return 0
        S, M = rows.valid.shape[1], max(rows.pos)  # a row's valid columns are its cached tokens: its position
        if S - M == 0 or S - M < max(8, (self.compact_slack - 1) * M):  # few holes: cheaper to keep than to move
            return 0
        # A stable sort puts each row's invalid columns first and keeps its valid ones in order.
        order = torch.sort(rows.valid.to(torch.int8), dim=1, stable=True).indices[:, S - M:]  # [B, M]
        rows.valid = rows.valid.gather(1, order)
        rows.cache.gather_columns(order)  # in place, inside each layer's buffer
        return 1
