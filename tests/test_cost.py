"""The cost model's parts are the decode loop's own step (``inference.cost.measure_parts`` calls
``inference.batched``'s step functions with one row), so the time a real decode takes is what the parts add up to
(the overhead ratio stays near 1 when the models dominate)."""

import time

import pytest
import torch

from heads.base import Drafter
from inference.cost import measure, measure_parts, overhead_ratio
from inference.decoder import Decoder
from inference.kv_cache import TREE_HEADROOM, PreallocatedCache
from inference.tree import DraftTree
from tests.test_decoder import noisy_medusa


class SecondSibling(Drafter):
    """Two root children, the target's greedy token second: every accepted path is [1], never a prefix."""

    def __init__(self, teacher):
        super().__init__({"hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size, "num_layers": 2})
        self.model, self.vocab = teacher.model, teacher.vocab_size

    def propose(self, tokens, max_depth, sampling=None):
        best = self.model(tokens).logits[0, -1].argmax().view(1)
        return DraftTree(torch.cat([(best + 1) % self.vocab, best]), torch.tensor([-1, -1]), chain_hint=False)


class SlowChain(Drafter):
    """A deterministic fake drafter whose costs are sleeps: ``draft_s`` per proposal, ``observe_s`` per hand-off
    (``observe``, which the loop calls inside its verification half). Proposes the last token repeated."""

    def __init__(self, teacher, draft_s: float, observe_s: float):
        super().__init__({"hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size, "num_layers": 2})
        self.draft_s, self.observe_s = draft_s, observe_s

    def observe(self, hidden):
        time.sleep(self.observe_s)

    def propose(self, tokens, max_depth, sampling=None):
        time.sleep(self.draft_s)
        return DraftTree.chain(tokens[0, -1:].repeat(max_depth))


def spy(monkeypatch, obj, name, calls):
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.setdefault(name, []).append((args, out))
        return out

    monkeypatch.setattr(obj, name, wrapper)


def test_measure_parts_times_the_decode_loops_own_step(tiny_teacher, monkeypatch):
    drafter = noisy_medusa(tiny_teacher, scale=0.2)
    drafter.set_tree("small")
    dec = Decoder(tiny_teacher)
    calls: dict = {}
    for name in ("_prefill", "_verify", "_commit", "_maybe_compact", "_draft"):
        spy(monkeypatch, dec.loop, name, calls)
    spy(monkeypatch, dec, "plain_step", calls)
    prompt = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    shapes = {3: torch.tensor([-1, 0, 0]), 2: torch.tensor([-1, 0])}
    parts = measure_parts(dec, drafter, prompt, [1, 3], shapes, repeats=3, catch_up=2, max_new_tokens=30)

    assert set(parts["t_verify_measured"]) == {0, 2, 3} and set(parts["t_draft"]) == {1, 3}
    assert len(calls["_prefill"]) == 3 and len(calls["plain_step"]) == 3
    # Every shape (and the empty proposal) through the loop's verification, commit and compaction, each repeat; and
    # before each timed proposal, an untimed verification of the largest shape (as between two proposals).
    assert len(calls["_verify"]) == len(calls["_commit"]) == len(calls["_maybe_compact"]) == 3 * 3 + 2 * 3
    verified = sorted(args[1][0].size for args, _ in calls["_verify"])
    assert verified == [0] * 3 + [2] * 3 + [3] * (3 + 2 * 3)
    # The loop's cache class and capacity rule: prompt (the prefilled context) + max_new_tokens + TREE_HEADROOM.
    rows, hidden = calls["_prefill"][0][1]
    assert isinstance(rows.cache, PreallocatedCache) and rows.cache.capacity == 19 + 30 + TREE_HEADROOM
    assert set(hidden) == set(drafter.teacher_layers)
    # Drafting through the drafter's batch state (an untimed proposal on the shorter context, then the timed one).
    drafted = [(args[0].draft, args[0].tokens[0].shape[1], args[1]) for args, _ in calls["_draft"]]
    assert len(drafted) == 2 * 2 * 3
    assert all(type(d).__name__ == type(drafter.rows([0])).__name__ for d, _, _ in drafted)
    assert [(n, depth) for _, n, depth in drafted[:4]] == [(18, 1), (20, 1), (18, 3), (20, 3)]
    # Rewound: after all that, the context is still the prompt minus its pending token.
    assert rows.cache.get_seq_length() == 19 and rows.valid.shape == (1, 19) and bool(rows.valid.all())


def test_the_parts_add_up_to_the_decode_that_runs(tiny_teacher):
    """Sleeps dominate a deterministic fake (target forward 10 ms, proposal 8 ms, hand-off 8 ms), so the overhead
    ratio of a real decode is near 1 exactly when the parts time the whole step; a model of the step that left out
    the hand-off (as the cost model once did) reads about 1.4. Bounds are loose for a loaded machine."""
    model = tiny_teacher.model
    handle = model.register_forward_pre_hook(lambda module, args: time.sleep(0.010))
    try:
        drafter = SlowChain(tiny_teacher, draft_s=0.008, observe_s=0.008)
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
    per_step = (gen.draft_seconds + gen.verify_seconds) / steps
    predicted = sum(c * (parts["t_draft"][3] + parts["t_verify"][n]) for n, c in gen.nodes_per_forward.items()) / steps
    assert predicted == pytest.approx(per_step, rel=0.25)  # the old model of the step: 0.70 of it
    ratio = overhead_ratio(gen.seconds, gen.prefill_seconds, gen.nodes_per_forward, parts["t_verify"],
                           parts["t_draft"][3])
    assert 0.8 < ratio < 1.25  # the old model of the step: 1.4
    assert parts["t_draft"][3] >= 0.008 and parts["t_verify"][3] >= 0.010 + 0.008  # forward + hand-off
    assert parts["t_plain"] == pytest.approx(0.010, abs=0.006)


def test_batch_one_keeps_its_cache_dense(tiny_teacher, monkeypatch):
    """At batch 1 the loop moves the accepted nodes' entries up behind the pending token every step (``keep_tail``),
    so its cache never holds holes (what a batch of several rows keeps until a compaction), and stays what plain
    decoding builds: greedy output is token-identical."""
    drafter = SecondSibling(tiny_teacher)
    dec = Decoder(tiny_teacher)
    seen = []
    real = dec.loop._verify

    def verify(rows, trees, layers):
        out = real(rows, trees, layers)
        seen.append((out[0][0].path, rows.valid.clone(), rows.cache.get_seq_length(), rows.pos[0]))
        return out

    monkeypatch.setattr(dec.loop, "_verify", verify)
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    gen = dec.speculative_eager(drafter, prompt, 40, 3)
    assert gen.new_tokens == dec.plain(prompt, 40).new_tokens
    assert len(seen) >= 5 and all(path == [1] for path, *_ in seen)  # node 0 rejected: a hole without the copy
    for path, valid, length, pos in seen:  # the cached tokens (pos), the pending one, the accepted node: no more
        assert bool(valid.all()) and valid.shape == (1, length) and length == pos + 1 + len(path)
