"""Cost model: predict the speedup of each draft length / tree size from measured parts, and pick the best.

Parts, each measured in isolation (medians of repeated calls, nothing else running in between), each by calling the
step that decoding runs (``measure``): at batch 1 the decoder's one-row steps on a moving context (``measure_steps``,
``inference.session.Session``):
    t_plain      one plain decoding step (``Session.plain_step``: a 1-token target forward, the token read back)
    t_verify(n)  one verification of n draft nodes (+ the pending token): inputs and mask, forward, acceptance with
                 its one read-back, a tree's compaction, the hand-off to the drafter (t_verify(0): nothing drafted)
    t_draft(d)   one drafter proposal of depth d, with the catch-up a real step gives the drafter
and, from decoding, the acceptance it achieved:
    chains:       α_i per position  ->  τ(γ) = 1 + Σ_{i=1..γ} Π_{j<=i} α_j
    static trees: P(node on the accepted path)  ->  τ(first n nodes) = 1 + Σ_{i<n} P(node i)
(both exact in expectation for greedy decoding; under sampling, acceptance of a node depends on its siblings'
residuals and the prediction is approximate). Then
    predicted speedup = (t_prefill + (n - 1) · t_plain) / (t_prefill + (n - 1) / τ · (t_draft + t_verify))
for n new tokens (both decoders pay one prefill, which yields the first token); per step, τ · t_plain / (t_d + t_v)
and the overhead ratio of a real run = its wall time / (prefill + Σ t_verify + Σ t_draft of the steps it took):
1.0 means the decode loop adds nothing to the work the models themselves do.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Mapping, Sequence

import torch

from inference.decoder import Decoder
from inference.generation import sync
from inference.proposer import Proposer
from inference.stats import AcceptStats, chain_tau
from inference.tree import DraftTree


def _seconds(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _fit_linear(medians: Mapping[int, float]) -> dict[int, float]:
    """t_verify(n) ≈ a + b·n over n >= 1, by least squares: one noisy size cannot steer a tuning decision. With
    fewer than three sizes the medians are kept as measured."""
    points = [(n, t) for n, t in medians.items() if n >= 1]
    if len(points) < 3:
        return dict(medians)
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / sum((n - mean_n) ** 2 for n, _ in points)
    slope = max(slope, 0.0)  # more nodes never make a forward cheaper
    return {n: (mean_t + slope * (n - mean_n)) if n >= 1 else t for n, t in medians.items()}


@torch.no_grad()
def measure_steps(decoder: Decoder, drafter: Proposer, prompt_ids: torch.Tensor, depths: Sequence[int],
                  shapes: Mapping[int, torch.Tensor], repeats: int = 15, chain_nodes: int | None = None,
                  max_new_tokens: int | None = None) -> dict:
    """t_prefill, t_plain, t_verify(n) for each tree shape (n -> parents), t_draft(d) for each depth (medians) of
    the decoder's one-row bucket (``inference.session.Session``), timed on a moving
    context: each part is one step of a running sequence (``Session``), which commits what it accepts, so no two
    repeats see the same context length (and no per-length state of an attention backend stays warm for free, as it
    does over a rewound context). t_prefill: a session's prefill and first token; t_plain: a plain step; t_verify(n):
    the verify step of a random tree of shape n (a chain in the bucket of a decode drafting ``chain_nodes``, default
    n: a real decode verifies every chain in the bucket of its γ, padded); t_draft(d): the
    drafter's proposal of depth d right after the verification of its previous one (the catch-up a real step gives
    it). Every part is run once before the timed repeats (a bucket's first step compiles or records it). The
    contexts stay within those of a real decode of ``max_new_tokens`` (default 64): a sequence that would pass them
    starts over from the prompt (untimed)."""
    device = decoder.device
    vocab = decoder.teacher.vocab_size
    shapes = {0: torch.empty(0, dtype=torch.long), **shapes}
    trees = {}
    for n, parents in shapes.items():
        chain = parents.tolist() == list(range(-1, parents.shape[0] - 1))
        trees[n] = (parents.to(device), chain, DraftTree(parents, parents).depth)
    deepest = max([*depths, *(t[2] for t in trees.values()), chain_nodes or 0, 1])
    room = max_new_tokens or 64  # committed tokens a sequence may reach, as in the decode being modelled
    widest = max([*shapes, *depths, deepest]) + 1
    gen = torch.Generator().manual_seed(0)
    times: dict = {"prefill": [], "plain": [], **{("v", n): [] for n in shapes}, **{("d", d): [] for d in depths}}

    def fresh(drafting: bool):
        if drafting:
            return decoder.session(drafter, prompt_ids, room + widest, deepest)
        return decoder.session(None, prompt_ids, room + 1, 0)

    with decoder.runner.pinned():
        plain, run = fresh(False), fresh(True)
        for r in range(repeats + 1):
            if len(plain.new) >= room:
                plain = fresh(False)
            timed = {"plain": _seconds(plain.plain_step, device)}
            for n, (parents, chain, depth) in trees.items():
                if len(run.new) + max(depth, 1) > room:  # as a real decode, whose drafts end at max_new_tokens
                    run = fresh(True)
                tokens = torch.randint(0, vocab, parents.shape, generator=gen).to(device)
                run.load(DraftTree(tokens, parents, chain_hint=chain, depth_bound=depth),
                         (chain_nodes or max(n, 1)) if chain else None)
                timed[("v", n)] = _seconds(run.verify, device)
            for d in depths:
                if len(run.new) + d > room:
                    run = fresh(True)
                timed[("d", d)] = _seconds(lambda d=d: run.draft(d), device)
                run.verify()
            if r:  # the first round compiles / records each bucket
                for key, t in timed.items():
                    times[key].append(t)
        # Last: a prefill starts its state's sequence over (the plain steps above share that state).
        times["prefill"] = [_seconds(lambda: decoder.session(None, prompt_ids, 1, 0), device)
                            for _ in range(repeats)]
    median = {key: statistics.median(v) for key, v in times.items()}
    measured = {n: median[("v", n)] for n in shapes}
    return {"t_prefill": median["prefill"], "t_plain": median["plain"], "t_verify": _fit_linear(measured),
            "t_verify_measured": measured, "t_draft": {d: median[("d", d)] for d in depths}}


def measure(decoder: Decoder, drafter: Proposer, prompt_ids: torch.Tensor, depths: Sequence[int],
            shapes: Mapping[int, torch.Tensor], repeats: int = 15, catch_up: int = 1,
            max_new_tokens: int | None = None, chain_nodes: int | None = None) -> dict:
    """The parts of the decode that runs: the decoder's one-row steps (``measure_steps``). Medusa's typical acceptance
    (lossy) is timed as the exact rule's steps, which cost the same forward and a like verdict. ``catch_up`` is
    what a step feeds the drafter; the decoder's own steps feed it what they accepted."""
    return measure_steps(decoder, drafter, prompt_ids, depths, shapes, repeats, chain_nodes, max_new_tokens)


def tree_tau(node_accept_rate: Sequence[float], num_nodes: int) -> float:
    return 1.0 + sum(node_accept_rate[:num_nodes])


def predict(tau: float, t_plain: float, t_draft: float, t_verify: float, new_tokens: int | None = None,
            t_prefill: float = 0.0) -> float:
    """Predicted speedup; with ``new_tokens``, the prefill both decoders pay (it yields the first token) is in it."""
    if new_tokens is None:
        return tau * t_plain / (t_draft + t_verify)
    steps = max(new_tokens - 1, 0)
    return (t_prefill + steps * t_plain) / (t_prefill + steps / tau * (t_draft + t_verify))


def overhead_ratio(wall_seconds: float, prefill_seconds: float, nodes_per_forward: Mapping[int, int],
                   t_verify: Mapping[int, float], t_draft: float) -> float:
    isolated = prefill_seconds + sum(c * (t_draft + t_verify[n]) for n, c in nodes_per_forward.items())
    return wall_seconds / isolated if isolated else float("nan")


def choose(candidates: list[dict]) -> dict:
    """The candidate with the highest predicted speedup (ties: the smaller, cheaper one)."""
    return max(candidates, key=lambda c: (round(c["predicted_speedup"], 6), -c["size"]))


def auto_tune(decoder: Decoder, drafter: Proposer, prompts: Sequence[torch.Tensor], max_new_tokens: int, max_depth: int,
              repeats: int = 15) -> dict:
    """Decode ``prompts`` at the largest setting, predict every smaller one, apply the best to ``drafter``.

    Chains: γ = 1..max_depth. Static trees (a drafter with a ``tree``): the first n nodes, n = 1..size (paths are
    sorted breadth-first, so every prefix is a tree). Returns {"candidates": [...], "chosen": {...}}."""
    if drafter.dynamic_tree:
        raise ValueError(
            f"decoder.auto_tune models chains and static trees, not {drafter.name}'s EAGLE-2 dynamic tree (its shape "
            f"changes every step); tune it as a chain (decoder.tree=chain decoder.auto_tune=true) or size the tree by "
            f"hand (drafter top_k / total_tokens, eval.num_draft)")
    stats, forwards, accepts = AcceptStats(), Counter(), Counter()
    static = drafter.tree
    full = len(static.paths) if static is not None else None
    for p in prompts:
        gen = decoder.speculative(drafter, p, max_new_tokens, max_depth)
        stats.merge(gen.stats)
        forwards.update(gen.nodes_per_forward)
        if full is not None:
            accepts.update(gen.node_accepts.get(full, {}))
    if static is None:
        sizes = list(range(1, max_depth + 1))
        depths = {n: n for n in sizes}
        shapes = {n: torch.arange(-1, n - 1) for n in sizes}
        taus = {n: chain_tau(stats.alpha_per_position, n) for n in sizes}
    else:
        sizes = list(range(1, full + 1))
        depths = {n: min(static.truncated(n).depth, max_depth) for n in sizes}
        shapes = {n: torch.tensor(static.truncated(n).parents) for n in sizes}
        rates = [accepts[i] / forwards[full] if forwards[full] else 0.0 for i in range(full)]
        taus = {n: tree_tau(rates, n) for n in sizes}
    parts = measure(decoder, drafter, prompts[0], sorted(set(depths.values())), shapes, repeats,
                    catch_up=max(1, round(stats.tau)), max_new_tokens=max_new_tokens)
    candidates = [
        {"size": n, "num_draft": depths[n], "tree_nodes": n if static is not None else None, "predicted_tau": taus[n],
         "t_draft_s": parts["t_draft"][depths[n]], "t_verify_s": parts["t_verify"][n],
         "predicted_speedup": predict(taus[n], parts["t_plain"], parts["t_draft"][depths[n]], parts["t_verify"][n],
                                      max_new_tokens, parts["t_prefill"])}
        for n in sizes
    ]
    best = choose(candidates)
    if static is not None:
        drafter.set_tree([list(p) for p in static.paths[: best["size"]]])
    return {"candidates": candidates, "chosen": best, "t_plain_s": parts["t_plain"]}
