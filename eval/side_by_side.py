"""Decoding prompts side by side: for each prompt, plain decoding, then every drafter and every baseline, back to back
from the same seed, so a machine that gets busier mid-run slows all of them alike and their ratios stay honest.

The one decode loop of an evaluation: the main measurement (``eval.run.evaluate``) and each context-length bucket
(``eval.context_lengths``) run through it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from eval.mismatch import MAX_KEPT, Mismatch, mismatch
from inference.decoder import Decoder
from inference.generation import Generation

log = logging.getLogger(__name__)


@dataclass
class Tally:
    """One decoding method over a set of prompts: the sum of its ``Generation``s, and how many matched plain greedy
    decoding (the reference)."""

    total: Generation = field(default_factory=lambda: Generation(new_tokens=[], seconds=0.0))
    prompts: int = 0
    identical: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)  # the first MAX_KEPT, for the logit gaps

    def add(self, gen: Generation, ref: Generation | None, index: int) -> None:
        self.total.merge(gen)
        self.prompts += 1
        if ref is not None:
            if gen.new_tokens == ref.new_tokens:
                self.identical += 1
                return
            if len(self.mismatches) < MAX_KEPT:
                self.mismatches.append(mismatch(index, ref.new_tokens, gen.new_tokens))

    @property
    def first_mismatch(self) -> int | None:
        return self.mismatches[0].prompt if self.mismatches else None

    @property
    def tokens(self) -> int:
        return len(self.total.new_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total.seconds if self.total.seconds else 0.0


@dataclass
class SideBySide:
    """The tallies of one side-by-side run: plain decoding, each drafter, each baseline, and per (method, category)
    (method None: plain decoding); ``first_ref`` is plain decoding's output for the first prompt."""

    plain: Tally
    drafters: dict[str, Tally]
    baselines: dict[str, Tally]
    by_category: dict
    first_ref: Generation
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)  # first ``keep`` prompts per method


# a baseline: (prompt [1, n], seed) -> its Generation
Baseline = Callable[[Tensor, int], Generation]


def warm_up(decoder: Decoder, drafters: Mapping, prompts: Sequence[Tensor], max_new: int, depth: Mapping[str, int],
            baselines: Mapping[str, Baseline] | None = None) -> None:
    """Decode ``prompts`` with every method, untimed: first calls pay one-off allocation costs."""
    for p in prompts:
        decoder.plain(p, max_new)
        for name, drafter in drafters.items():
            decoder.speculative(drafter, p, max_new, depth[name])
        for run in (baselines or {}).values():
            run(p, 0)


def decode_side_by_side(decoder: Decoder, drafters: Mapping, prompts: Sequence[Tensor], max_new: int,
                        depth: Mapping[str, int], seed: int, categories: Sequence[str | None] | None = None,
                        baselines: Mapping[str, Baseline] | None = None, keep: int = 0) -> SideBySide:
    """Every prompt decoded plainly, by each drafter (``depth[name]`` draft tokens deep) and by each baseline, back to
    back, each from the seed ``seed + prompt index``. Under greedy decoding every output is checked against plain
    decoding's. The outputs of the first ``keep`` prompts are kept per method (``SideBySide.outputs``)."""
    greedy, baselines = decoder.sampling.greedy, baselines or {}
    categories = list(categories) if categories is not None else [None] * len(prompts)
    run = SideBySide(plain=Tally(), drafters={name: Tally() for name in drafters},
                     baselines={name: Tally() for name in baselines}, by_category=defaultdict(Tally), first_ref=None)
    for idx, (p, cat) in enumerate(zip(prompts, categories)):
        decoder.reseed(seed + idx)  # the same random stream for every method on this prompt
        ref = decoder.plain(p, max_new)
        if idx == 0:
            run.first_ref = ref
        run.plain.add(ref, None, idx)
        if idx < keep:
            run.outputs.setdefault("plain", []).append(ref.new_tokens)
        run.by_category[(None, cat)].add(ref, None, idx)
        for name, drafter in drafters.items():
            decoder.reseed(seed + idx)
            gen = decoder.speculative(drafter, p, max_new, depth[name])
            run.drafters[name].add(gen, ref if greedy else None, idx)
            if idx < keep:
                run.outputs.setdefault(name, []).append(gen.new_tokens)
            run.by_category[(name, cat)].add(gen, None, idx)
            if greedy and gen.new_tokens != ref.new_tokens and run.drafters[name].first_mismatch == idx:
                log.warning("drafter %s: prompt %d differs from plain greedy decoding", name, idx)
        for name, baseline in baselines.items():
            run.baselines[name].add(baseline(p, seed + idx), ref if greedy else None, idx)
    return run
