"""The batched decoder's capture-safe draft steps (inference.batch_draft): a batch-1 static draft run for R rows under
``torch.vmap``.

- the mechanism: at every step each row of the batched draft equals what the batch-1 static draft drafts from that
  row's committed tokens alone, for every drafter kind with a static draft; a finished row's state does not move;
- the decoder: batches of 1, 3 and 8 ragged prompts, rows finishing at different steps (EOS, ragged acceptance), each
  row token-identical to its batch-1 greedy decode and accepting exactly what the batch-1 step decoder's static draft
  gets accepted, through the static step only (the eager rows never asked);
- plain steps chosen by a policy keep the draft state in step; a drafter without a static draft still drafts through
  its eager rows;
- compiled (``torch.compile(fullgraph=True, dynamic=False)``): one draft graph per batch bucket, no recompile over
  decodes of >= 64 steps; under inductor, the batch-1 drafts still;
- re-bucketing into buffers allocated for a longer decode keeps every row's draft state.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from distill.teacher import Teacher
from inference.batch_decoder import BucketDecoder
from inference.batch_draft import RowDrafts
from inference.decoder import Decoder
from inference.sampling import GREEDY
from inference.static_draft import new_committed
from tests.drafters import build, dspark, medusa, tiny_llama
from tests.static_harness import Replay, counts
from tests.test_batch_decoder import ragged_prompts

NEW = 20
KINDS = ["eagle1", "eagle3", "medusa_chain", "medusa_tree", "dflash", "dspark", "dspark_cut", "peagle", "draft_model"]


@pytest.fixture(scope="module")
def teacher():
    """A 4-layer tiny Llama (EAGLE-3 and P-EAGLE read layers 1..3) whose greedy output varies."""
    return Teacher(tiny_llama(initializer_range=0.2, num_hidden_layers=4), tokenizer=None, name="tiny-llama-4")


def drafter_of(kind: str, teacher):
    if kind == "medusa_chain":
        return medusa(teacher, tree=None)
    if kind == "medusa_tree":
        return medusa(teacher)
    if kind == "dspark_cut":  # verified in the bucket of what its confidence cut keeps, per row
        return dspark(teacher, confidence_threshold=0.4)
    return build(kind, teacher)


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts()


@pytest.fixture(scope="module")
def eos(teacher, prompts):
    """The token whose first occurrence in the greedy continuations falls at the most different places: rows stopping
    at it finish at different steps."""
    refs = [Decoder(teacher).plain(p[None], NEW).new_tokens for p in prompts]
    firsts = {t: {r.index(t) for r in refs if t in r[1:]} for r in refs for t in r[1:]}
    return max(sorted(firsts), key=lambda t: len(firsts[t]))


def copies_refused(drafter):
    """``drafter`` whose per-row copies (``heads.base.ForkedRows``) fail when asked: a decode that uses them is not
    on the static path."""
    def refuse(seeds):
        raise AssertionError("per-row copies drafted: the static draft step was not used")
    drafter.rows = refuse
    return drafter


# --- the mechanism ----------------------------------------------------------------------------------------------------


class FakeVerify:
    """What ``RowDrafts`` reads of the batched verify's buffers (``inference.batch_steps.BatchSteps``), written by the
    test from R replayed batch-1 continuations."""

    def __init__(self, drafter, R: int, M: int, T: int, capacity: int):
        self.R, self.max_nodes = R, T
        self.committed_ids = torch.zeros(R, M, dtype=torch.long)
        self.committed_hidden = {i: torch.zeros(R, M, drafter.dims.hidden_size) for i in drafter.teacher_layers}
        self.out = torch.zeros(R, 4 + 2 * T, dtype=torch.long)
        self.pending = torch.zeros(R, dtype=torch.long)
        self.active = torch.ones(R, dtype=torch.long)
        self.tokens_RT = torch.full((R, T), -1, dtype=torch.long)
        self.parents_RT = torch.full((R, T), -1, dtype=torch.long)
        self.probs_RTV = None
        self.cache = type("Cache", (), {"length": torch.zeros(R, dtype=torch.long), "capacity": capacity})()


@pytest.mark.parametrize("kind", KINDS)
def test_each_row_drafts_what_its_batch1_static_draft_drafts(teacher, kind):
    """Three rows of different prompt lengths, each accepting its own number of tokens per step, drafted together:
    every step, row r's draft (tokens and parents) equals a batch-1 static draft fed row r alone; from step 6 row 1 is
    finished and its drafts are token -1, its scalar state (lengths, flags) unchanged."""
    drafter = drafter_of(kind, teacher)
    R, M, capacity, steps = 3, 4, 128, 10
    layers = tuple(drafter.teacher_layers)
    alone = []
    for r in range(R):
        committed = new_committed(M, layers, drafter.dims.hidden_size, "cpu", torch.float32)
        alone.append((committed, drafter.static_draft(committed, capacity, GREEDY, None)))
    proto_committed = new_committed(M, layers, drafter.dims.hidden_size, "cpu", torch.float32)
    proto = drafter.static_draft(proto_committed, capacity, GREEDY, None)
    T = proto.buffers.tokens_T.shape[0]
    verify = FakeVerify(drafter, R, M, T, capacity)
    rows = RowDrafts(drafter, proto, proto_committed, verify)
    replays = [Replay(teacher, layers, 5 + 7 * r, new_tokens=M * steps + 2, seed=r) for r in range(R)]
    for r, (replay, (_, static)) in enumerate(zip(replays, alone)):
        replay.prefill(static)
    P = max(x.prompt_len for x in replays)
    hidden = {i: torch.stack([torch.cat([x.hidden[i][: x.prompt_len], x.hidden[i][:P - x.prompt_len]])
                              for x in replays]) for i in layers}
    rows.prefill([x.seq[: x.prompt_len] for x in replays], hidden, torch.stack([x.seq[x.prompt_len] for x in replays]))
    accepted = [counts(steps, M, seed=r) for r in range(R)]
    frozen = None
    for step in range(steps):
        if step:
            for r, (replay, (committed, _)) in enumerate(zip(replays, alone)):
                if not verify.active[r]:
                    continue
                replay.commit(committed, accepted[r][step])
                verify.committed_ids[r].copy_(committed.ids_M)
                for i in layers:
                    verify.committed_hidden[i][r].copy_(committed.hidden_M[i])
                verify.out[r, 0] = committed.count - 1
                verify.pending[r] = committed.pending
                verify.cache.length[r] = replay.position
        if step == 6:
            verify.active[1] = 0
            frozen = [rows.stacked[k][1].clone() for k in rows.scalars]
        context = max(x.position for x in replays)
        rows.use_shape(context)
        rows.draft()
        for r, (replay, (_, static)) in enumerate(zip(replays, alone)):
            if not verify.active[r]:
                assert (verify.tokens_RT[r, :T] == -1).all()
                assert all(torch.equal(rows.stacked[k][r], v) for k, v in zip(rows.scalars, frozen))
                continue
            if hasattr(static, "use_shape"):
                static.use_shape(context, True)
            static.draft()
            assert torch.equal(verify.tokens_RT[r, :T], static.buffers.tokens_T), (kind, step, r)
            if not rows.chain:
                assert torch.equal(verify.parents_RT[r, :T], static.buffers.parents_T), (kind, step, r)


# --- the decoder ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_batches_of_1_3_and_8_accept_what_batch1_static_drafts_get_accepted(teacher, prompts, eos, kind):
    """Every row token-identical to its batch-1 greedy decode (stopping at EOS, so rows finish at different steps),
    and with the same per-step accepted counts as the batch-1 step decoder drafting through the same static draft:
    the batched drafts are the batch-1 ones, row by row, near the end of a row's budget included."""
    drafter = copies_refused(drafter_of(kind, teacher))
    single = Decoder(teacher, eos_token_id=eos)
    refs = [single.speculative(drafter, p[None], NEW, 3) for p in prompts]
    assert [r.new_tokens for r in refs] == [single.plain(p[None], NEW).new_tokens for p in prompts]
    assert len({len(r.new_tokens) for r in refs}) > 1, "the test needs rows that stop at different lengths"
    decoder = BucketDecoder(teacher, eos_token_id=eos, cuda_graphs="off", compile="off")
    buckets = set()
    for batch in (1, 3, 8):
        for i in range(0, len(prompts), batch):
            gen = decoder.speculative(drafter, prompts[i: i + batch], NEW, 3)
            buckets.add(tuple(sorted(gen.bucket_steps)))
            for j, g in enumerate(gen.generations):
                ref = refs[i + j]
                assert g.new_tokens == ref.new_tokens, f"{kind}, batch {batch}: prompt {i + j} differs from batch 1"
                assert g.stats.counts == ref.stats.counts, f"{kind}, batch {batch}: prompt {i + j} accepted otherwise"
    assert any(len(b) > 1 for b in buckets), f"{kind}: no batch moved to a smaller bucket: {buckets}"
    assert any(key[1] == "draft" for key in decoder._fns)


@pytest.mark.parametrize("kind", ["eagle1", "dflash", "draft_model"])
def test_rows_move_into_a_bucket_allocated_for_longer_decodes(teacher, prompts, eos, kind):
    """A long decode leaves buckets 4, 2 and 1 with a larger capacity than a later short decode's bucket 8: the short
    decode's rows then move into buffers of another size (another batch-1 draft of the same kind) and still draft
    what the batch-1 static draft drafts."""
    drafter = copies_refused(drafter_of(kind, teacher))
    decoder = BucketDecoder(teacher, eos_token_id=eos, cuda_graphs="off", compile="off")
    decoder.speculative(drafter, prompts[:3], 200, 3)
    gen = decoder.speculative(drafter, prompts, NEW, 3)
    capacities = {rows: state.cache.capacity for (rows, *_), state in decoder._states.items()}
    assert capacities[8] < capacities[4] and len(gen.bucket_steps) > 1
    single = Decoder(teacher, eos_token_id=eos)
    for p, g in zip(prompts, gen.generations):
        ref = single.speculative(drafter, p[None], NEW, 3)
        assert g.new_tokens == ref.new_tokens and g.stats.counts == ref.stats.counts


class Alternating:
    """A policy drafting γ = 3 and 0 (a plain step) in turn, whatever the live batch."""

    def __init__(self):
        self.calls = 0

    def __call__(self, live: int) -> int:
        self.calls += 1
        return 3 if self.calls % 2 else 0


@pytest.mark.parametrize("kind", ["dflash", "dspark", "draft_model"])
def test_plain_steps_keep_the_static_draft_in_step(teacher, prompts, kind):
    """Plain steps between drafted ones (a load-aware policy's γ = 0): the static draft catches up on them, so each
    row is accepted exactly what per-row copies of the eager ``propose`` (which observe every step) get accepted.
    (Chains: a tree clipped near the end of a row's budget is counted by its full depth on the static path, as at
    batch 1, by the clipped one on the copies.)"""
    drafter = drafter_of(kind, teacher)
    decoder = BucketDecoder(teacher, cuda_graphs="off", compile="off")
    static = decoder.speculative(drafter, prompts, NEW, 3, policy=Alternating())
    assert any(key[1] == "draft" for key in decoder._fns)
    refs = [Decoder(teacher).plain(p[None], NEW).new_tokens for p in prompts]
    assert [g.new_tokens for g in static.generations] == refs
    assert static.gamma_steps[0] > 0 and static.gamma_steps[3] > 0
    eager = BucketDecoder(teacher, cuda_graphs="off", compile="off")
    drafter.static_draft = lambda *args, **kwargs: None  # per-row copies of the eager propose
    try:
        rows = eager.speculative(drafter, prompts, NEW, 3, policy=Alternating())
    finally:
        del drafter.static_draft
    assert not any(key[1] == "draft" for key in eager._fns)
    assert [g.stats.counts for g in static.generations] == [g.stats.counts for g in rows.generations]
    assert sum(a * c for g in static.generations for row in g.stats.counts.values() for a, c in row.items()) > 0


def test_a_drafter_without_a_static_draft_drafts_through_per_row_copies(teacher, prompts):
    drafter = build("dflash", teacher)
    drafter.static_draft = lambda *args, **kwargs: None
    asked = []
    rows = drafter.rows
    drafter.rows = lambda seeds: asked.append(len(seeds)) or rows(seeds)
    decoder = BucketDecoder(teacher, cuda_graphs="off", compile="off")
    gen = decoder.speculative(drafter, prompts[:3], NEW, 3)
    assert asked == [3]
    assert [g.new_tokens for g in gen.generations] == [Decoder(teacher).plain(p[None], NEW).new_tokens
                                                        for p in prompts[:3]]


# --- compiled ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dflash", "eagle1"])
def test_one_draft_graph_per_bucket_and_no_recompile_over_long_decodes(teacher, prompts, kind):
    """``torch.compile(fullgraph=True, dynamic=False)`` (dynamo): after a warm-up decode of 3 prompts (buckets 4 -> 2
    -> 1 as rows finish), the same decode again with recompiles refused; one graph per step function the decoder made
    (verify steps and one draft step per batch bucket), >= 64 steps, every row its batch-1 greedy decode."""
    torch._dynamo.reset()
    counters.clear()
    drafter = copies_refused(drafter_of(kind, teacher))
    decoder = BucketDecoder(teacher, cuda_graphs="off", compile="on", compile_backend="eager")
    batch = prompts[:3]
    first = decoder.speculative(drafter, batch, 100, 3)
    graphs = counters["stats"]["unique_graphs"]
    assert not counters["graph_break"], dict(counters["graph_break"])
    with torch.compiler.set_stance("fail_on_recompile"):
        gen = decoder.speculative(drafter, batch, 100, 3)
    assert counters["stats"]["unique_graphs"] == graphs == len(decoder._fns)
    draft_steps = [key for key in decoder._fns if key[1] == "draft"]
    rows = {decoder._drafts[k].R for k in decoder._drafts}
    assert len(draft_steps) == len(rows) == len(gen.bucket_steps) > 1  # one draft graph per batch bucket
    assert gen.steps >= 64
    single = Decoder(teacher)
    refs = [single.plain(p[None], 100).new_tokens for p in batch]
    assert [g.new_tokens for g in gen.generations] == [g.new_tokens for g in first.generations] == refs


def test_inductor_compiled_draft_steps_draft_what_batch1_drafts(teacher, prompts):
    """The draft step at every bucket compiled by inductor (the default backend), no fallback: each row its batch-1
    greedy decode, with the batch-1 static draft's accepted counts."""
    drafter = copies_refused(drafter_of("dflash", teacher))
    decoder = BucketDecoder(teacher, cuda_graphs="off", compile="on")
    gen = decoder.speculative(drafter, prompts, NEW, 3)
    assert decoder.runner.fallback_reason is None
    assert any(key[1] == "draft" for key in decoder._fns)
    single = Decoder(teacher)
    for p, g in zip(prompts, gen.generations):
        ref = single.speculative(drafter, p[None], NEW, 3)
        assert g.new_tokens == ref.new_tokens and g.stats.counts == ref.stats.counts
