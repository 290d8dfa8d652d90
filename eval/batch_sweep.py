"""The batch sweep: when does a drafter stop paying? Throughput and latency of batched decoding vs batch size.

For each batch size B in ``decoder.batch_sizes`` the same prompts are decoded in batches of B (``inference.batch_decoder``)
three ways, back to back per batch (in an order shuffled from batch to batch, seeded) so a machine that gets busier
mid-run slows all of them alike:
    off     plain batched decoding (one token per sequence per step)
    always  speculative, γ = ``eval.num_draft`` every step
    auto    speculative, γ chosen per step by the load-aware policy (``inference.policy``; only when
            ``decoder.policy=auto``), from a cost table calibrated once per drafter before the sweep
            (``inference.policy.calibrate``: decodes at every B and γ, ``repeats`` rounds, as long as the sweep's,
            since acceptance changes along a generation)
The prompt pool is the evaluation prompts, repeated to a multiple of the largest B so every batch is full; a B with
fewer than ``min_batches`` batches in the pool goes over it again (each row reports its ``batches`` per round: a
large B's round is a few batches, about a second on the toy, so raise ``min_batches`` for a longer timed window).
With ``rounds`` > 1 the whole pass over the pool runs that many times per B (a new shuffle each round) and each
method reports its median round by tokens/s (its other figures from that same round; identical_to_plain over all
rounds): a burst of load on a shared machine then moves one round, not the row.

Reported per B: tokens/s (all new tokens / wall time of all batches), latency (per sequence: time until it leaves the
batch / its new tokens, mean, ms per token), τ, speedup = always / off, and auto / max(always, off) (goal >= 0.95).
The crossover batch size is the first measured B where speculation no longer beats plain decoding (speedup < 1),
with a log2-linear interpolation between the last B where it paid and that one.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from inference.batch_decoder import BucketDecoder
from inference.generation import BatchGeneration
from inference.batch_memory import check_batch_sizes_fit
from inference.decoder import DecoderConfig
from inference.policy import calibrate, check_batch_sizes, make_policy
from inference.stats import AcceptStats
from train.config import EvalConfig

log = logging.getLogger(__name__)

POLICY_GOAL = 0.95  # auto's throughput over the better of always-on / always-off


@dataclass
class _Tally:
    seconds: float = 0.0
    tokens: int = 0
    latency_ms: list = field(default_factory=list)  # per sequence: ms per new token until it left its batch
    stats: AcceptStats = field(default_factory=AcceptStats)
    gammas: dict = field(default_factory=dict)  # γ -> steps
    identical: bool = True

    def add(self, gen: BatchGeneration, ref: BatchGeneration | None) -> None:
        self.seconds += gen.seconds
        self.tokens += gen.new_tokens
        self.latency_ms += [1000 * g.seconds / len(g.new_tokens) for g in gen.generations if g.new_tokens]
        self.stats.merge(gen.stats)
        for g, steps in gen.gamma_steps.items():
            self.gammas[g] = self.gammas.get(g, 0) + steps
        if ref is not None:
            self.identical &= all(a.new_tokens == b.new_tokens for a, b in zip(gen.generations, ref.generations))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def row(self, greedy: bool) -> dict:
        steps = sum(self.gammas.values())
        return {"tokens_per_s": self.tokens_per_s, "seconds": self.seconds,
                "new_tokens": self.tokens, "latency_ms_per_token": sum(self.latency_ms) / max(1, len(self.latency_ms)),
                "tau": self.stats.tau, "alpha": self.stats.alpha,
                "gamma_steps": {str(g): c for g, c in sorted(self.gammas.items())},
                "mean_gamma": sum(g * c for g, c in self.gammas.items()) / steps if steps else 0.0,
                "identical_to_plain": self.identical if greedy else None}


def median_round(rounds: list[_Tally]) -> _Tally:
    """The round with the median tokens/s (the lower middle of an even count), identical only if every round was."""
    pick = sorted(rounds, key=lambda t: t.tokens_per_s)[(len(rounds) - 1) // 2]
    pick.identical = all(t.identical for t in rounds)
    return pick


def sweep_prompts(prompts: Sequence, batch_sizes: Sequence[int]) -> list:
    """The prompts repeated (in order) to a multiple of the largest batch size."""
    if not prompts:
        raise ValueError("no prompts for the batch sweep; check eval.prompts / eval.num_prompts")
    largest = max(batch_sizes)
    n = math.ceil(max(len(prompts), largest) / largest) * largest
    return [prompts[i % len(prompts)] for i in range(n)]


def batch_sweep(teacher, drafters: Mapping[str, object], prompts: Sequence, eval_cfg: EvalConfig, dcfg: DecoderConfig,
                repeats: int = 2, min_batches: int = 2, rounds: int = 1) -> dict:
    """Decode ``prompts`` at every batch size of ``dcfg.batch_sizes``: plain, always-on and (``dcfg.policy=auto``)
    the load-aware policy, for each drafter; ``rounds`` passes per batch size, each method's median round reported.
    Returns the JSON-able ``report["batch_sweep"]``."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1 (passes over the prompts per batch size)")
    if min_batches < 1:
        raise ValueError(f"min_batches={min_batches} must be >= 1 (batches timed per round at each batch size)")
    batch_sizes = check_batch_sizes(dcfg.batch_sizes)
    max_new, gamma = eval_cfg.max_new_tokens, eval_cfg.num_draft
    check_batch_sizes_fit(teacher, batch_sizes, dcfg.max_batch_rows, eval_cfg.prompt_tokens, max_new, gamma)
    eos = teacher.tokenizer.eos_token_id if getattr(teacher, "tokenizer", None) is not None else None
    decoder = BucketDecoder(teacher, eos_token_id=eos, sampling=dcfg.sampling(), seed=dcfg.seed,
                               cuda_graphs=dcfg.cuda_graphs, compile=dcfg.compile, max_rows=dcfg.max_batch_rows)
    greedy = decoder.sampling.greedy
    pool = sweep_prompts(list(prompts), batch_sizes)
    policies = {name: {"always": None} for name in drafters}
    tables = {}
    if dcfg.policy == "auto":
        for name, drafter in drafters.items():
            tables[name] = calibrate(decoder, drafter, pool, gamma, batch_sizes, max_new, repeats)
            policies[name]["auto"] = make_policy("auto", tables[name], gamma)
            log.info("batch sweep %s: policy γ by batch size %s", name, policies[name]["auto"].plan(batch_sizes))
    decoder.plain(pool[:2], min(4, max_new))  # first calls pay one-off allocation costs
    for drafter in drafters.values():
        decoder.speculative(drafter, pool[:2], min(4, max_new), gamma)
    methods = [None] + [(name, p) for name, pols in policies.items() for p in pols]  # None: plain decoding
    rows = []
    for B in batch_sizes:
        chunks = [pool[s: s + B] for s in range(0, len(pool), B)]
        chunks *= math.ceil(min_batches / len(chunks))  # a large B still gets a few batches' worth of timing
        passes = []
        for r in range(rounds):
            tallies = {m: _Tally() for m in methods}
            for k, chunk in enumerate(chunks):
                gens = {}
                # A seeded shuffle per batch: no method always goes first or always follows the same one (a fixed
                # rotation put each auto run right after its drafter's always-on run).
                for m in random.Random(f"{dcfg.seed}/{B}/{r}/{k}").sample(methods, len(methods)):
                    decoder.reseed(dcfg.seed + k)  # the same random stream for every method on this batch
                    gens[m] = (decoder.plain(chunk, max_new) if m is None else
                               decoder.speculative(drafters[m[0]], chunk, max_new, gamma, policy=policies[m[0]][m[1]]))
                for m, gen in gens.items():
                    tallies[m].add(gen, gens[None] if greedy and m is not None else None)
            passes.append(tallies)
        tallies = {m: median_round([p[m] for p in passes]) for m in methods}
        per_drafter = {name: {p: tallies[(name, p)].row(greedy) for p in pols} for name, pols in policies.items()}
        rows.append({"batch_size": B, "batches": len(chunks), "plain": tallies[None].row(greedy=False),
                     "drafters": per_drafter})
        log.info("batch sweep B=%d: %s", B, {m or "plain": round(t.tokens_per_s, 1) for m, t in tallies.items()})
    return _summarise(rows, drafters, tables, policies, batch_sizes, len(pool), max_new, gamma, dcfg, rounds,
                      min_batches)


def _summarise(rows, drafters, tables, policies, batch_sizes, num_prompts, max_new, gamma, dcfg, rounds,
               min_batches) -> dict:
    summary = {}
    for name in drafters:
        off = [r["plain"]["tokens_per_s"] for r in rows]
        on = [r["drafters"][name]["always"]["tokens_per_s"] for r in rows]
        for r, o, p in zip(rows, on, off):
            cell = r["drafters"][name]
            cell["always"]["speedup"] = o / p if p else None
            if "auto" in cell:
                best = max(o, p)
                cell["auto"]["vs_best"] = cell["auto"]["tokens_per_s"] / best if best else None
        entry = {**crossover(batch_sizes, on, off)}
        if name in tables:
            ratios = [r["drafters"][name]["auto"]["vs_best"] for r in rows]
            entry.update(policy_min_vs_best=min(ratios), policy_goal=POLICY_GOAL,
                         policy_goal_met=min(ratios) >= POLICY_GOAL,
                         policy_plan={str(b): g for b, g in policies[name]["auto"].plan(batch_sizes).items()},
                         cost_table=tables[name].to_dict())
        summary[name] = entry
    return {"batch_sizes": batch_sizes, "num_prompts": num_prompts, "max_new_tokens": max_new, "num_draft": gamma,
            "policy": dcfg.policy, "rounds": rounds, "min_batches": min_batches,
            "sampling": {"temperature": dcfg.temperature, "top_p": dcfg.top_p, "top_k": dcfg.top_k},
            "rows": rows, "drafters": summary}


def crossover(batch_sizes: Sequence[int], on_tps: Sequence[float], off_tps: Sequence[float]) -> dict:
    """Where speculation stops paying: the first B with on <= off after one where it paid (None: it pays at every
    measured B; the first B: it never pays), and a log2-linear interpolation of speedup = 1 between the two."""
    speedups = [on / off if off else 0.0 for on, off in zip(on_tps, off_tps)]
    first = next((i for i, s in enumerate(speedups) if s <= 1.0), None)
    if first is None:
        return {"crossover_batch_size": None, "crossover_interpolated": None,
                "crossover_note": f"speculation pays at every measured batch size (up to {batch_sizes[-1]})"}
    if first == 0:
        return {"crossover_batch_size": batch_sizes[0], "crossover_interpolated": None,
                "crossover_note": f"speculation does not pay even at batch size {batch_sizes[0]}"}
    (b0, s0), (b1, s1) = (batch_sizes[first - 1], speedups[first - 1]), (batch_sizes[first], speedups[first])
    x = math.log2(b0) + (s0 - 1.0) / (s0 - s1) * (math.log2(b1) - math.log2(b0))
    return {"crossover_batch_size": b1, "crossover_interpolated": 2 ** x,
            "crossover_note": f"speculation stops paying between batch sizes {b0} and {b1} (about {2 ** x:.1f})"}


# --- rendering: summary lines, markdown, figure ------------------------------------------------------------------


def sweep_lines(sweep: Mapping) -> list[str]:
    lines = [f"batch sweep ({sweep['num_prompts']} prompts, γ={sweep['num_draft']}, policy={sweep['policy']}):"]
    for name, entry in sweep["drafters"].items():
        cells = []
        for r in sweep["rows"]:
            d = r["drafters"][name]
            cell = f"B={r['batch_size']}: {d['always']['speedup']:.2f}x"
            if "auto" in d:
                cell += f" (auto {d['auto']['vs_best']:.2f} of best)"
            cells.append(cell)
        lines.append(f"  {name}: " + ", ".join(cells) + f"; {entry['crossover_note']}")
    return lines
