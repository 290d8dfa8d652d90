"""A draft model drafting B sequences at once: one draft-model forward per draft step for the whole batch.

``heads.draft_model.DraftModel`` holds the model; this module drafts with it for the batched decode loop
(``inference.batch_decoder``; batch 1 is a batch of one). ``DraftModel.rows`` returns a ``DraftModelRows`` unless the draft
model has sliding-window or other non-plain attention layers (those keep per-row copies, ``heads.base.ForkedRows``,
whose ``DynamicCache`` can roll their windows back).

The ragged draft cache (``inference.kv_cache.RaggedCache``). Row b's fed ids have their keys and values in columns
0 .. len_b - 1 of one preallocated buffer per layer: its context, then every draft of its last proposal but the last
(the last draft is never fed). A proposal first *catches up* each row: the columns still right for its new context
stay (``accepted`` says how many: the context + the accepted drafts; without it the ids are compared), the rest of
its context (usually the target's one new token, or the last draft and that token) is fed in one forward for every
row, left-padded to the longest: row b's real entries are scattered to columns keep_b, keep_b + 1, ..., padding
entries to a scratch column past every row. Then each draft step feeds every row's previous draft (one column per
row, at its own length). Positions are columns, and a 4D mask shows each query its own row's columns up to its own
position, so each row computes what batch-1 drafting computes for it. Rolling a row back (rejected drafts) is
forgetting its length: nothing is copied or cropped. When every row is equally long and feeds as many tokens (always
at batch 1) the forward appends behind the cache's shared length with the model's own causal mask instead.

Drafts are the argmax (greedy rows), or drawn from the warped draft distribution (``inference.sampling.warp``) with
the row's own generator, seeded as the row's ``ForkedRows`` copy would be and drawn from only for the row's own
``depths[b]`` drafts, so a row's sampled drafts are those its per-row copy draws (up to the last bits of the batched
forward's arithmetic). Every row drafts max(depths) tokens; row b's chain is its first depths[b].

Shapes: B rows, M tokens fed per row in one forward, E the longest row's length after it, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.generation import cache_kwarg
from inference.kv_cache import RaggedCache
from inference.sampling import SamplingConfig, sample, warp
from inference.tree import DraftTree

PAD_ID = 0  # fed in padding slots; its entries land in the scratch column and its queries' outputs are unused


class DraftModelRows:
    """The decoding state of B sequences for one ``DraftModel`` (``inference.proposer.ProposerRows``)."""

    def __init__(self, drafter, seeds: list[int]):
        self.drafter = drafter
        self.device = drafter.device  # a batch is decoded where its drafter is
        config = drafter.model.config.get_text_config()
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.seeds = list(seeds)
        self.generators: list[torch.Generator | None] = [None] * len(seeds)
        self.cache: RaggedCache | None = None
        self.lengths = [0] * len(seeds)  # columns holding the row's fed ids (host: shapes only, never read back)
        self.fed: list[tuple[Tensor, Tensor] | None] = [None] * len(seeds)  # (context, drafts) those ids came from
        self.proposed: list[tuple[int, int] | None] = [None] * len(seeds)  # (context length, drafts) of the last
        self.valid: list[int | None] = [None] * len(seeds)  # fed columns still right after ``accepted`` (None: compare)

    def __len__(self) -> int:
        return len(self.seeds)

    def observe(self, row: int, hidden: dict[int, Tensor]) -> None:
        """A draft model reads no target hidden states."""

    def accepted(self, row: int, path: list[int], committed: list[int] | None = None) -> None:
        # The row's cache holds its context and every draft but the last; the accepted ones stay valid.
        if self.proposed[row] is not None:
            context, drafts = self.proposed[row]
            self.valid[row] = context + min(len(path), drafts - 1)
            self.proposed[row] = None

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` (in this order) stay in the batch."""
        for name in ("seeds", "generators", "lengths", "fed", "proposed", "valid"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in rows])
        if self.cache is not None:
            self.cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.device))

    # Inference mode, not just no_grad: the draft model's many small ops skip autograd's version counters and view
    # tracking (~15% of a toy draft forward on CPU). The cache and the drafts are inference tensors, which the
    # decoder only reads.
    @torch.inference_mode()
    def propose(self, tokens: list[Tensor], depths: list[int], samplings: list[SamplingConfig]) -> list[DraftTree]:
        """Row b's chain of at most ``depths[b]`` drafts continuing ``tokens[b]`` ([1, n_b])."""
        D = max(depths)
        if D < 1:
            return [DraftTree.empty(t.device) for t in tokens]
        seqs = [t[0].to(self.device) for t in tokens]
        longest = max(s.shape[0] for s in seqs)
        if self.max_positions and longest + D - 1 > self.max_positions:
            self.drafter._check_positions(longest, D)  # raises, naming the settings to change
        keep = [self._resync(b, s) for b, s in enumerate(seqs)]
        logits_BV, ends = self._catch_up(seqs, keep, D)
        drafts, probs = [], []
        for k in range(D):
            if k:  # the previous draft goes in; the last draft never does
                logits_BV = self._step(drafts[-1], ends, k)
            tok_B, probs_B = self._pick(logits_BV, k, depths, samplings)
            drafts.append(tok_B)
            probs.append(probs_B)
        drafts_BD = torch.stack(drafts, 1)
        trees = []
        for b, (seq, d) in enumerate(zip(seqs, depths)):
            self.lengths[b] = seq.shape[0] + D - 1
            self.fed[b], self.proposed[b], self.valid[b] = (seq, drafts_BD[b, : D - 1]), (seq.shape[0], D), None
            rows = [p[b] for p in probs[:d]]
            probs_NV = torch.stack(rows).to(tokens[b].device) if d and rows[0] is not None else None
            trees.append(DraftTree.chain(drafts_BD[b, :d].to(tokens[b].device), probs_NV) if d
                         else DraftTree.empty(tokens[b].device))
        return trees

    def _resync(self, b: int, seq: Tensor) -> int:
        """How many of row b's cached columns are still right for the context ``seq`` (its last token is always
        re-fed: its logits are needed)."""
        if self.fed[b] is None:
            return 0
        n = min(self.lengths[b], seq.shape[0] - 1)
        if self.valid[b] is not None:  # told by ``accepted``: no comparison read back from the device
            keep = min(self.valid[b], n)
        else:
            cached = torch.cat(self.fed[b])[:n]
            differs = (cached != seq[:n]).nonzero()
            keep = int(differs[0]) if differs.numel() else n
        self.valid[b] = self.proposed[b] = None
        return keep

    def _catch_up(self, seqs: list[Tensor], keep: list[int], D: int) -> tuple[Tensor, Tensor | None]:
        """Feed every row's context past its kept columns in one forward; return the logits after each row's last
        token [B, V] and, when rows differ in length, each row's next free column [B] (on the device)."""
        dev, B = self.device, len(seqs)
        new = [s.shape[0] - k for s, k in zip(seqs, keep)]
        M, E = max(new), max(k + m for k, m in zip(keep, new))
        if self.cache is None:
            self.cache = RaggedCache(capacity=2 * (E + D))
        if len(set(keep)) == 1 and len(set(new)) == 1:  # rows alike: append with the model's own causal mask
            self.cache.set_length(keep[0])
            self.cache.write_at(None)
            ids = seqs[0][keep[0]:][None] if B == 1 else torch.stack([s[k:] for s, k in zip(seqs, keep)])
            return self._forward(ids), None
        ids = torch.full((B, M), PAD_ID, dtype=torch.long, device=dev)
        for b, (s, k, m) in enumerate(zip(seqs, keep, new)):  # left padding: every row's last token is in column M-1
            ids[b, M - m:] = s[k:]
        # Row b's block index i is its position keep_b - (M - m_b) + i; a padding index (i < M - m_b) writes to the
        # scratch column E and, at position 0, sees column 0 (any finite entry: its output is never used).
        meta = torch.empty(2, B, dtype=torch.long, device=dev)  # (keep, block start) per row
        for b, (k, m) in enumerate(zip(keep, new)):
            meta[0, b].fill_(k)  # fill_: a scalar argument, not a tensor built from Python data (no host copy)
            meta[1, b].fill_(k - (M - m))
        pos = meta[1][:, None] + torch.arange(M, device=dev)
        real = pos >= meta[0][:, None]
        pos = torch.where(real, pos, 0)
        self.cache.write_at(torch.where(real, pos, E), E)
        return self._forward(ids, pos, self._mask(pos, E)), pos[:, -1] + 1

    def _step(self, tok_B: Tensor, ends: Tensor | None, k: int) -> Tensor:
        """Feed each row's draft k - 1 behind its context; logits [B, V]."""
        if ends is None:
            return self._forward(tok_B[:, None])
        pos = (ends + (k - 1))[:, None]  # [B, 1]
        E = self.cache.extent + 1
        self.cache.write_at(pos, E)
        return self._forward(tok_B[:, None], pos, self._mask(pos, E))

    def _mask(self, pos_BM: Tensor, E: int) -> Tensor:
        """[B, 1, M, E] additive: a query sees its own row's columns up to its position."""
        allowed = torch.arange(E, device=pos_BM.device)[None, None, :] <= pos_BM[:, :, None]
        dtype = self.drafter.model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=pos_BM.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)[:, None]

    def _forward(self, ids_BM: Tensor, pos_BM: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        kw = {"logits_to_keep": 1} if self.drafter._logits_to_keep else {}
        if pos_BM is not None:
            kw.update(position_ids=pos_BM, attention_mask=mask)
        kw[cache_kwarg(self.drafter.model)] = self.cache
        out = self.drafter.model(input_ids=ids_BM, use_cache=True, **kw)
        return out.logits[:, -1]

    def _pick(self, logits_BV: Tensor, k: int, depths: list[int],
              samplings: list[SamplingConfig]) -> tuple[Tensor, list[Tensor | None]]:
        """Draft k of every row [B] and, for sampled rows, the distribution it was drawn from ([V] per row)."""
        B = logits_BV.shape[0]
        top_B = logits_BV.argmax(-1)  # greedy rows, and rows past their own depth (fed, never proposed)
        drawn = [b for b in range(B) if not samplings[b].greedy and k < depths[b]]
        if not drawn:
            return top_B, [None] * B
        shared = samplings[0] if len(set(samplings)) == 1 else None
        warped = warp(logits_BV, shared) if shared is not None else None
        toks, probs = list(top_B.unbind(0)), [None] * B
        for b in drawn:
            p_1V = warped[b:b + 1] if warped is not None else warp(logits_BV[b:b + 1], samplings[b])
            toks[b], probs[b] = sample(p_1V, self._sampler(b))[0], p_1V[0]
        return torch.stack(toks), probs

    def _sampler(self, b: int) -> torch.Generator:
        if self.generators[b] is None:
            self.generators[b] = torch.Generator(device=self.device).manual_seed(self.seeds[b])
        return self.generators[b]
