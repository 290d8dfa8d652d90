"""The cost model's parts are the step decoder's own steps (``inference.cost.measure``), so the time a real decode
takes is what the parts add up to (the overhead ratio stays near 1 when the models dominate)."""

import time

import pytest
import torch

from heads.base import Drafter
from inference.cost import measure, overhead_ratio
from inference.decoder import Decoder
from inference.tree import DraftTree


class Clock:
    """A virtual ``time.perf_counter``: only the scripted costs advance it, so the figures are the same on an idle
    machine and a loaded one (how fast the decode runs is a benchmark's question, not a unit test's)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


class SlowChain(Drafter):
    """A deterministic fake drafter whose costs are given times on ``clock``: ``draft_s`` per proposal,
    ``observe_s`` per hand-off (``observe``, which the loop calls inside its verification half). Proposes the last
    token repeated."""

    def __init__(self, teacher, clock: Clock, draft_s: float, observe_s: float):
        super().__init__({"hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size, "num_layers": 2})
        self.clock, self.draft_s, self.observe_s = clock, draft_s, observe_s

    def observe(self, hidden):
        self.clock.spend(self.observe_s)

    def propose(self, tokens, max_depth, sampling=None):
        self.clock.spend(self.draft_s)
        return DraftTree.chain(tokens[0, -1:].repeat(max_depth))


def test_the_parts_add_up_to_the_decode_that_runs(tiny_teacher, monkeypatch):
    """Given times (target forward 10 ms, proposal 8 ms, hand-off 8 ms) on a virtual clock: the parts the cost model
    measures time the whole step, so they add up to the decode that runs (overhead ratio 1); a model of the step
    that left out the hand-off (as the cost model once did) would read about 1.4."""
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = tiny_teacher.model
    handle = model.register_forward_pre_hook(lambda module, args: clock.spend(0.010))
    try:
        drafter = SlowChain(tiny_teacher, clock, draft_s=0.008, observe_s=0.008)
        dec = Decoder(tiny_teacher)
        prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
        gen = dec.speculative(drafter, prompt, 24, 3)
        steps = sum(gen.nodes_per_forward.values())
        assert steps >= 6
        context = torch.cat([prompt, torch.tensor([gen.new_tokens[:6]])], 1)
        parts = measure(dec, drafter, context, [3], gen.shapes, repeats=5, catch_up=max(1, round(gen.stats.tau)),
                        max_new_tokens=24, chain_nodes=3)  # the parts of the decode that runs (the step path)
    finally:
        handle.remove()
    assert parts["t_plain"] == pytest.approx(0.010)  # one target forward
    assert parts["t_draft"][3] == pytest.approx(0.008)
    assert parts["t_verify"][3] == pytest.approx(0.010 + 0.008)  # forward + hand-off
    per_step = (gen.draft_seconds + gen.verify_seconds) / steps
    predicted = sum(c * (parts["t_draft"][3] + parts["t_verify"][n]) for n, c in gen.nodes_per_forward.items()) / steps
    assert predicted == pytest.approx(per_step)
    ratio = overhead_ratio(gen.seconds, gen.prefill_seconds, gen.nodes_per_forward, parts["t_verify"],
                           parts["t_draft"][3])
    assert ratio == pytest.approx(1.0)
    without_hand_off = {n: t - 0.008 for n, t in parts["t_verify"].items()}
    assert overhead_ratio(gen.seconds, gen.prefill_seconds, gen.nodes_per_forward, without_hand_off,
                          parts["t_draft"][3]) > 1.3  # the check tells a model missing a part from a whole one
