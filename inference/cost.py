"""Cost model: predict the speedup of each draft length / tree size from measured parts, and pick the best.

Parts, each measured in isolation (medians of repeated calls on a fixed context, nothing else running in between):
    t_plain      one plain decoding step (a 1-token target forward)
    t_verify(n)  one verification forward of n draft nodes (+ the pending token), acceptance and cache compaction
    t_draft(d)   one drafter proposal of depth d
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
from transformers import DynamicCache

from inference.decoder import Decoder
from inference.generation import sync
from inference.proposer import Proposer
from inference.stats import AcceptStats, chain_tau
from inference.tree import DraftTree, compact_cache, verify_inputs


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
def measure_parts(decoder: Decoder, drafter: Proposer, prompt_ids: torch.Tensor, depths: Sequence[int],
                  shapes: Mapping[int, torch.Tensor], repeats: int = 15, catch_up: int = 1) -> dict:
    """t_prefill, t_plain, t_verify(n) for each tree shape (n -> parents), t_draft(d) for each depth: medians.

    Every round times each part once, so a machine that gets busier mid-measurement slows all parts alike (the
    parts are compared with each other). ``catch_up``: tokens the drafter has not seen when a proposal starts (in
    a real step, the accepted drafts and the bonus: about τ). A stateful drafter (a draft LM with its own cache)
    pays for feeding them, so each timed proposal follows an untimed one on the context without its last
    ``catch_up`` tokens."""
    device = decoder.device
    tokens = prompt_ids.to(device)
    layers = tuple(drafter.teacher_layers)
    vocab = decoder.teacher.vocab_size
    gen = torch.Generator().manual_seed(0)
    past = tokens.shape[1] - 1
    behind = tokens[:, : max(1, tokens.shape[1] - catch_up)]
    shapes = {0: torch.empty(0, dtype=torch.long), **shapes}
    state = {}

    def prefill():
        state["cache"] = DynamicCache(config=decoder.model.config)
        state["hidden"] = decoder._forward({"input_ids": tokens[:, :-1], **decoder.prefill_kw}, state["cache"], layers)[1]

    def verify(parents: torch.Tensor):
        cache = state["cache"]
        # The shape's facts from its host copy, as a drafter states them: timing adds no read-back a step lacks.
        chain = parents.tolist() == list(range(-1, parents.shape[0] - 1))
        tree = DraftTree(torch.randint(0, vocab, parents.shape, generator=gen).to(device), parents.to(device),
                         chain_hint=chain)
        logits, _ = decoder._forward(verify_inputs(tree, tokens[0, -1], past, decoder.mask_dtype), cache, layers)
        decoder.verdict(tree, logits)
        compact_cache(cache, tree.size, [])
        cache.crop(-1)  # the pending token too: back to the same context for the next repeat

    times: dict = {"prefill": [], **{("v", n): [] for n in shapes}, **{("d", d): [] for d in depths}}
    drafter.reset()
    for _ in range(repeats):
        times["prefill"].append(_seconds(prefill, device))
        for n, parents in shapes.items():
            times[("v", n)].append(_seconds(lambda p=parents: verify(p), device))
        drafter.observe(state["hidden"])  # the context minus its last token, as after a step
        for d in depths:
            drafter.propose(behind, d, decoder.sampling)
            times[("d", d)].append(_seconds(lambda d=d: drafter.propose(tokens, d, decoder.sampling), device))
    median = {key: statistics.median(v) for key, v in times.items()}
    measured = {n: median[("v", n)] for n in shapes}
    return {"t_prefill": median["prefill"], "t_plain": measured[0], "t_verify": _fit_linear(measured),
            "t_verify_measured": measured, "t_draft": {d: median[("d", d)] for d in depths}}


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
    parts = measure_parts(decoder, drafter, prompts[0], sorted(set(depths.values())), shapes, repeats,
                          catch_up=max(1, round(stats.tau)))
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
