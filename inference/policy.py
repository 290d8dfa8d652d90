"""Load-aware speculation: per step, draft γ tokens (0 = a plain step) where the measured costs say it pays.

Under a batch the target forward is shared: its cost grows with the live batch size B and the tokens per row n;
drafting is one call for the batch (``inference.batch_decoder``), one forward per level for every row (EAGLE) or a loop
over rows (the others), so its cost is measured per batch size too. From three parts, measured in the decode loop itself
(``measure_steps``: decodes at every B and fixed γ)
    t_verify(B, n)  one batched verification step (forward, per-row acceptance, cache bookkeeping), n = 1 + γ
    t_draft(γ)      one proposal of depth γ for one sequence, catch-up included (t_draft(0) = 0: no proposal)
    t_draft(B, γ)   one step's proposals for B live rows (whatever the drafter batches), where measured
    τ(γ)            tokens committed per sequence per step when drafting γ, from the calibration decodes at
                    the largest γ: τ(γ) = 1 + E[min(accepted, γ)] over their steps (exact for greedy chains whose
                    shorter proposal is a prefix of the longer one; an estimate otherwise)
the expected throughput of a step is
    tokens/s(B, γ) = B · τ(γ) / (t_verify(B, 1 + γ) + t_draft(B, γ))      (t_draft(B, γ) = B · t_draft(γ) if unmeasured)
and the policy picks the γ in 0..γ_max that maximises it for the current live batch (ties: the smaller γ; and γ = 0
unless the best beats a plain step by more than a small margin, as calibration is noisy). As B grows, verification
stops being free and γ shrinks, down to 0 where speculation no longer pays.

t_verify is measured at the batch sizes of the sweep and interpolated linearly in B between them (the live batch
shrinks as sequences finish); below the smallest measured B the smallest's figures are used, above the largest the
last two are extrapolated.

That per-step model misses what a batch of B pays over its life: its rows accept at different rates, so they finish
at different steps, and the batch runs as many steps as its slowest row needs (a prompt with nothing for the drafter
to match runs one token per step, at the cost of a speculative step), with fewer and fewer live rows. Where
calibration decoded whole batches (``calibrate`` does), the table keeps their measured throughput
    tokens/s(B, γ) = new tokens / seconds of all steps, over the calibration batches of B rows at fixed γ
(γ = 0: plain decoding, what the policy runs when it declines to speculate at a batch's start) and the policy
compares those instead: measured on the toy at batch 8, prompt lookup's per-step model predicted γ = 2 to beat plain
decoding by 4%, where the batches ran at 0.87x (an earlier scripts/results/bench_batch_toy_cpu.json).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from inference.batch_decoder import BucketDecoder
from inference.cost import _fit_linear
from inference.stats import AcceptStats

POLICIES = ("always", "auto")  # decoder.policy: always = γ = eval.num_draft every step; auto = LoadAwarePolicy


@dataclass
class CostTable:
    t_verify: dict[int, dict[int, float]]  # batch size -> tokens per row n (1 = plain step) -> seconds per step
    t_draft: dict[int, float]  # γ -> seconds per proposal per sequence
    tau: dict[int, float]  # γ -> expected tokens committed per sequence per step; tau[0] = 1
    # batch size -> γ -> seconds of one step's proposals for all live rows (batched drafting); None: B · t_draft[γ]
    t_draft_batch: dict[int, dict[int, float]] | None = None
    # batch size -> γ -> tokens/s of whole batches decoded at fixed γ (γ 0: plain); when given, ``throughput`` reads
    # it (interpolated in B) instead of the per-step model: see the module docstring
    batch_tps: dict[int, dict[int, float]] | None = None
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.t_verify:
            raise ValueError("cost table has no t_verify measurements; measure at least one batch size")
        self.t_draft = {0: 0.0, **self.t_draft}
        self.tau = {0: 1.0, **self.tau}

    @property
    def gammas(self) -> list[int]:
        if self.batch_tps:
            return sorted(set.intersection(*(set(row) for row in self.batch_tps.values())) | {0})
        sizes = set(self.t_verify[min(self.t_verify)])
        return sorted(g for g in self.tau if g in self.t_draft and g + 1 in sizes)

    def verify_seconds(self, batch: int, n: int) -> float:
        return _interpolate(self.t_verify, batch, n)

    def draft_seconds(self, batch: int, gamma: int) -> float:
        """One step's proposals for ``batch`` live rows."""
        if gamma == 0:
            return 0.0
        if self.t_draft_batch:
            return _interpolate(self.t_draft_batch, batch, gamma)
        return batch * self.t_draft[gamma]

    def step_seconds(self, batch: int, gamma: int) -> float:
        return self.verify_seconds(batch, gamma + 1) + self.draft_seconds(batch, gamma)

    def throughput(self, batch: int, gamma: int) -> float:
        """Expected committed tokens per second with ``batch`` live sequences drafting ``gamma``: measured over whole
        batches where calibrated so, else of one step by the per-step model."""
        if self.batch_tps:
            return _interpolate(self.batch_tps, batch, gamma)
        return batch * self.tau[gamma] / self.step_seconds(batch, gamma)

    def best_gamma(self, batch: int, max_gamma: int | None = None, margin: float = 0.0) -> int:
        """The γ with the highest expected throughput (ties: the smaller); 0 unless it beats a plain step by more
        than ``margin`` (a fraction), since a small predicted gain is within the measurement noise."""
        key = (batch, max_gamma, margin)
        if key not in self._memo:
            options = [g for g in self.gammas if max_gamma is None or g <= max_gamma]
            best = max(options, key=lambda g: (round(self.throughput(batch, g), 9), -g))
            plain = self.throughput(batch, 0)
            self._memo[key] = best if self.throughput(batch, best) > (1 + margin) * plain else 0
        return self._memo[key]

    def to_dict(self) -> dict:
        """JSON-able (string keys), for reports."""
        return {"t_verify_s": {str(b): {str(n): s for n, s in row.items()} for b, row in self.t_verify.items()},
                "t_draft_s": {str(g): s for g, s in self.t_draft.items()},
                "tau": {str(g): t for g, t in self.tau.items()},
                "t_draft_batch_s": {str(b): {str(g): s for g, s in row.items()}
                                    for b, row in (self.t_draft_batch or {}).items()},
                "batch_tokens_per_s": {str(b): {str(g): s for g, s in row.items()}
                                       for b, row in (self.batch_tps or {}).items()}}


def _interpolate(by_batch: dict[int, dict[int, float]], batch: int, key: int) -> float:
    """``by_batch[B][key]`` at ``batch``: linear between measured batch sizes, the smallest's below them, the last
    two's line above them (never below the smaller of those two)."""
    sizes = sorted(by_batch)
    if batch <= sizes[0] or len(sizes) == 1:
        return by_batch[sizes[0]][key]
    hi = next((s for s in sizes if s >= batch), sizes[-1])
    lo = sizes[sizes.index(hi) - 1]
    t_lo, t_hi = by_batch[lo][key], by_batch[hi][key]
    return max(t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo), min(t_lo, t_hi))


class LoadAwarePolicy:
    """``policy(live_batch_size) -> γ`` for ``BucketDecoder.speculative``: the best γ <= ``max_gamma`` by the table,
    speculating only where that beats a plain step by more than ``margin`` (default 3%: calibration noise)."""

    def __init__(self, table: CostTable, max_gamma: int, margin: float = 0.03):
        if max_gamma < 0:
            raise ValueError(f"max_gamma must be >= 0, got {max_gamma}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.table, self.max_gamma, self.margin = table, max_gamma, margin

    def __call__(self, live: int) -> int:
        return self.table.best_gamma(live, self.max_gamma, self.margin)

    def plan(self, batch_sizes: Sequence[int]) -> dict[int, int]:
        """The γ chosen at each batch size (for reports)."""
        return {b: self(b) for b in batch_sizes}


def make_policy(name: str, table: CostTable | None, num_draft: int):
    """None (fixed γ = ``num_draft``) for ``always``; a ``LoadAwarePolicy`` for ``auto``."""
    if name not in POLICIES:
        raise ValueError(f"decoder.policy={name!r} is not a policy; valid: {list(POLICIES)}")
    if name == "always":
        return None
    if table is None:
        raise ValueError("decoder.policy=auto needs a cost table; measure one with inference.policy.calibrate")
    return LoadAwarePolicy(table, num_draft)


def tau_by_gamma(stats: AcceptStats, max_gamma: int) -> dict[int, float]:
    """τ(γ) = 1 + E[min(accepted, γ)] over the steps in ``stats`` (decoded at γ = ``max_gamma``)."""
    cells = [(a, c) for row in stats.counts.values() for a, c in row.items()]
    total = sum(c for _, c in cells)
    if not total:
        return {g: 1.0 for g in range(max_gamma + 1)}
    return {g: 1.0 + sum(min(a, g) * c for a, c in cells) / total for g in range(max_gamma + 1)}


@torch.no_grad()
def measure_steps(decoder: BucketDecoder, drafter, prompts: Sequence, batch_sizes: Sequence[int], max_gamma: int,
                  tokens: int = 16, repeats: int = 2, min_rows: int = 16) -> tuple[dict, dict, AcceptStats, dict, dict]:
    """Step costs measured in the decode loop itself, so they include everything a real step pays (the drafter's
    catch-up on accepted tokens, cache bookkeeping, a cache warmed by the other model's last call).

    For every B and γ = 0..``max_gamma`` (interleaved, ``repeats`` rounds, each on the next B prompts): decode B
    prompts for ``tokens`` new tokens at fixed γ (small B gets more rounds, at least ``min_rows`` rows per γ: a single
    prompt's step times and acceptance are too noisy to decide on, and small batches are cheap to repeat). t_verify(B, 1 + γ) = mean verification time of the steps where all
    B rows were live, fitted linearly in γ >= 1 per B (``inference.cost._fit_linear``: one noisy size must not steer
    a decision); t_draft(γ) = mean draft time per row over those steps at every B, t_draft(B, γ) = mean draft time
    per step at B (a batched drafter's cost is not B times one row's). Means, not medians: throughput is set by the
    mean, and step times are skewed. γ = 0 is plain decoding (``decoder.plain``: no drafter kept in step), as the
    policy runs a batch it declines to speculate on from the start. Returns (t_verify, t_draft, the acceptance of the
    γ = max runs, t_draft(B, γ), tokens/s(B, γ) over the whole decodes: new tokens / seconds of all their steps)."""
    verify: dict[int, dict[int, float]] = {}
    draft: dict[int, list[float]] = {g: [] for g in range(1, max_gamma + 1)}
    draft_batch: dict[int, dict[int, float]] = {}
    life: dict[int, dict[int, float]] = {}
    stats = AcceptStats()
    for B in sorted(set(batch_sizes)):
        decoder.speculative(drafter, prompts[:B], min(tokens, 3), max_gamma)  # first calls of a shape pay allocations
        times: dict[int, list[float]] = {g: [] for g in range(max_gamma + 1)}
        step_draft: dict[int, list[float]] = {g: [] for g in range(1, max_gamma + 1)}
        made = {g: [0, 0.0] for g in times}  # γ -> [new tokens, seconds of every step]
        for r in range(max(repeats, -(-min_rows // B))):
            batch = [prompts[(r * B + i) % len(prompts)] for i in range(B)]
            for g in times:
                gen = decoder.speculative(drafter, batch, tokens, g) if g else decoder.plain(batch, tokens)
                made[g][0] += gen.new_tokens
                made[g][1] += sum(draft_s + verify_s for _, _, draft_s, verify_s in gen.step_log)
                full = [s for s in gen.step_log if s[0] == B] or gen.step_log
                times[g] += [verify_s for _, _, _, verify_s in full]
                if g:
                    draft[g] += [draft_s / live for live, _, draft_s, _ in full]
                    step_draft[g] += [draft_s * B / live for live, _, draft_s, _ in full]
                if g == max_gamma:
                    stats.merge(gen.stats)
        # Fitted over γ >= 1 with the plain step (γ = 0) as measured: a first draft token can cost more than each
        # further one (another attention / acceptance path), as in inference.cost, which keys by draft nodes too.
        fitted = _fit_linear({g: statistics.fmean(t) for g, t in times.items() if t})
        verify[B] = {g + 1: s for g, s in fitted.items()}
        draft_batch[B] = {g: statistics.fmean(t) for g, t in step_draft.items() if t}
        life[B] = {g: n / s for g, (n, s) in made.items() if s > 0}
    return verify, {g: statistics.fmean(t) for g, t in draft.items() if t}, stats, draft_batch, life


def calibrate(decoder: BucketDecoder, drafter, prompts: Sequence, max_gamma: int, batch_sizes: Sequence[int],
              tokens: int = 16, repeats: int = 2) -> CostTable:
    """The policy's cost table for ``drafter``: ``measure_steps`` at every batch size, τ(γ) from its γ = max runs."""
    if max_gamma < 1:
        raise ValueError(f"eval.num_draft must be >= 1 to calibrate a speculation policy, got {max_gamma}")
    verify, draft, stats, draft_batch, life = measure_steps(decoder, drafter, prompts, batch_sizes, max_gamma, tokens,
                                                            repeats)
    return CostTable(verify, draft, tau_by_gamma(stats, max_gamma), draft_batch, life)


def check_batch_sizes(sizes) -> list[int]:
    """``decoder.batch_sizes`` as a sorted list of distinct ints >= 1."""
    try:
        values = [int(b) for b in sizes] if sizes is not None and not isinstance(sizes, (str, int)) else None
    except (TypeError, ValueError):
        values = None
    if not values or any(b < 1 or b != s for b, s in zip(values, sizes)):
        raise ValueError(f"decoder.batch_sizes must be a non-empty list of integers >= 1, got {sizes!r}; "
                         f"e.g. decoder.batch_sizes=[1,2,4,8,16,32] (null: no batch sweep)")
    return sorted(set(values))
