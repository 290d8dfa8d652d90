"""The load-aware policy's whole-batch measurements (``inference.policy``): a batch runs as many steps as its slowest
row needs, which the per-step model (t_verify, t_draft, τ) cannot see; calibration measures it directly."""

import pytest

from inference.generation import BatchGeneration
from inference.generation import Generation
from inference.policy import CostTable, LoadAwarePolicy, calibrate, measure_steps

SIZES = (1, 4)


def per_step_table(batch_tps=None) -> CostTable:
    """Verification almost free, τ high: the per-step model says speculate at every B."""
    t_verify = {B: {n: 1e-3 + 1e-6 * n for n in range(1, 4)} for B in SIZES}
    return CostTable(t_verify, {1: 1e-6, 2: 2e-6}, {1: 1.8, 2: 2.5}, batch_tps=batch_tps)


def test_whole_batch_throughput_overrides_the_per_step_model():
    assert LoadAwarePolicy(per_step_table(), 2).plan(SIZES) == {1: 2, 4: 2}
    measured = {1: {0: 100.0, 1: 150.0, 2: 180.0}, 4: {0: 400.0, 1: 380.0, 2: 300.0}}
    table = per_step_table(measured)
    assert LoadAwarePolicy(table, 2).plan(SIZES) == {1: 2, 4: 0}
    assert table.throughput(4, 1) == 380.0 and table.throughput(2, 0) == pytest.approx(200.0)  # linear in B
    assert LoadAwarePolicy(table, 1)(1) == 1  # never above the configured γ
    # a gain inside the margin is not taken
    assert LoadAwarePolicy(per_step_table({1: {0: 100.0, 1: 102.0, 2: 101.0}, 4: measured[4]}), 2)(1) == 0
    assert table.to_dict()["batch_tokens_per_s"]["4"]["2"] == 300.0


class RaggedDecoder:
    """A stand-in decoder whose speculative batches have cheap full-batch steps but a long tail: one row of every
    batch accepts nothing, so the batch runs as many steps as plain decoding, each at a speculative step's cost."""

    def __init__(self):
        self.plain_calls = 0

    def plain(self, batch, tokens):
        self.plain_calls += 1
        return self._gen(len(batch), tokens, [(len(batch), 0, 0.0, 1e-3)] * tokens)

    def speculative(self, drafter, batch, tokens, gamma):
        B = len(batch)
        if B == 1 or gamma == 0:  # a batch of one gets its row's τ = 1 + γ; γ 0 is never asked for here
            return self._gen(B, tokens, [(1, gamma, 1e-5, 1.2e-3)] * -(-tokens // (1 + gamma)), gamma)
        fast = -(-tokens // (1 + gamma))  # steps until the fast rows are done: full-batch steps
        log = [(B, gamma, 1e-5, 1.2e-3)] * fast + [(1, gamma, 1e-5, 1.2e-3)] * (tokens - fast)
        return self._gen(B, tokens, log, gamma)

    @staticmethod
    def _gen(B, tokens, log, gamma=0):
        gen = BatchGeneration(generations=[Generation(new_tokens=[1] * tokens, seconds=0.0) for _ in range(B)])
        gen.step_log = log
        for _ in range(len(log)):
            gen.stats.update(gamma, gamma)
        return gen


def test_calibration_sees_the_slowest_row():
    decoder = RaggedDecoder()
    verify, draft, stats, draft_batch, life = measure_steps(decoder, None, list(range(8)), SIZES, 2, tokens=12,
                                                            repeats=1, min_rows=1)
    assert decoder.plain_calls == len(SIZES)  # γ 0 is plain decoding (one round per B here)
    assert set(life) == set(SIZES) and all(set(row) == {0, 1, 2} for row in life.values())
    assert life[1][2] > life[1][0]  # alone, a row speculates profitably
    assert life[4][2] < life[4][0]  # in a batch, the slow row's 12 speculative steps cost more than 12 plain ones
    table = CostTable(verify, draft, {1: 2.0, 2: 3.0}, draft_batch)
    assert table.best_gamma(4, 2) == 2  # the per-step model, fitted on full-batch steps only, would speculate
    assert CostTable(verify, draft, {1: 2.0, 2: 3.0}, draft_batch, life).best_gamma(4, 2) == 0


def test_calibrate_keeps_the_whole_batch_figures(monkeypatch):
    import inference.policy as policy

    monkeypatch.setattr(policy, "tau_by_gamma", lambda stats, g: {k: 1.0 + k for k in range(g + 1)})
    table = calibrate(RaggedDecoder(), None, list(range(8)), 2, SIZES, tokens=12, repeats=1)
    assert table.batch_tps and LoadAwarePolicy(table, 2).plan(SIZES) == {1: 2, 4: 0}
