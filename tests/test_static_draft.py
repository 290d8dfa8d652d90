"""Drafters' static draft steps (``inference.static_draft.StaticDraft``): played through a stand-in for the decoder
(``tests.static_harness``) over a greedy continuation of a tiny target, with a varying accepted length per step and
two prompt lengths in one capacity bucket. Each step compiles to one graph with no break and no recompile,
keeps every tensor it touches at one address, shape and stride, runs attention at a bounded set of shapes and a fixed
number of ops, and drafts exactly what the eager ``propose`` drafts on the same context (greedy). A sampled draft-model
chain draws from its own warped distributions with uniforms made in the step; decoding through ``Decoder`` with each
static step gives plain greedy decoding's tokens. A shaped step (``use_shape``) keeps all of that in every capacity
bucket; EAGLE's attends over the smallest bucket holding its draft, growing across a bucket boundary, with one compiled
graph per bucket."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from distill.teacher import Teacher
from heads.draft_model.model import DraftModel
from inference.static_draft import hashed_uniforms
from heads.medusa.model import MedusaHeads
from heads.medusa.medusa2 import Medusa2
from inference.acceptance import sample_uniform
from inference.batch_decoder import BucketDecoder
from inference.decoder import Decoder
from inference.runner import compiled_of
from inference.sampling import GREEDY, SamplingConfig, warp
from tests.conftest import make_tiny_llama
from tests.static_harness import Recorder, Replay, committed_for, counts, layout, play_steps, tensors_of
from tests.drafters import truncated
from tests.test_eagle import DIMS, make as make_eagle

CAPACITY = 256
PROMPTS = (7, 12)  # two prompt lengths in one capacity bucket
STEPS = 34  # per prompt: 68 steps in all


def eagle(teacher, variant, tree, **kw):
    drafter = make_eagle(teacher, variant, tree=tree, **kw)
    return drafter, 5  # committed rows: 1 + the draft depth


def medusa(teacher, tree, cls=MedusaHeads):
    torch.manual_seed(0)
    drafter = cls(DIMS, num_heads=4, tree=tree)
    MedusaHeads.bind_target(drafter, teacher, initialize=True)  # the heads only (Medusa-2's LoRA: the target's)
    with torch.no_grad():  # heads that differ from the target's lm_head and from each other
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval(), 5


def draft_model(teacher):
    # room for the shape tests' contexts past the target's 256 positions (the draft model refuses a draft past its own)
    drafter = DraftModel(DIMS, model=truncated(teacher.model, max_position_embeddings=1024))
    drafter.bind_target(teacher, initialize=False)
    return drafter.eval(), 5


KINDS = {
    "eagle1-dynamic": lambda t: eagle(t, "eagle1", "dynamic"),
    "eagle1-chain": lambda t: eagle(t, "eagle1", "chain"),
    "eagle3-dynamic": lambda t: eagle(t, "eagle3", "dynamic", draft_vocab_size=96),
    "eagle3-chain": lambda t: eagle(t, "eagle3", "chain", draft_vocab_size=96),
    "medusa-chain": lambda t: medusa(t, None),
    "medusa-tree": lambda t: medusa(t, "default"),
    "medusa2-tree": lambda t: medusa(t, "small", Medusa2),
    "draft-model": draft_model,
}
# Distinct attention (query, key) shapes a step may run: the catch-up's and one per level width.
ATTENTION_SHAPES = {"eagle1-dynamic": 2, "eagle1-chain": 2, "eagle3-dynamic": 2, "eagle3-chain": 2,
                    "medusa-chain": 0, "medusa-tree": 0, "medusa2-tree": 0,
                    "draft-model": 2}

# Aten ops per draft step (views aside), measured with a little headroom: a regression guard (the eager propose
# runs 290 for EAGLE-1's tree, 359 for EAGLE-3's, 230 for the draft model's chain, 22 for Medusa's).
OP_BUDGET = {"eagle1-dynamic": 280, "eagle1-chain": 275, "eagle3-dynamic": 350, "eagle3-chain": 345,
             "medusa-chain": 30, "medusa-tree": 30, "medusa2-tree": 30, "draft-model": 260}


@pytest.fixture(scope="module")
def target():
    return Teacher(make_tiny_llama(initializer_range=0.2), tokenizer=None, name="tiny-llama-varied")


def play(drafter, static, committed, target, prompt_len, steps, step_fn, check=None, shape=None):
    """``play_steps``, and after each step the draft compared with the eager ``propose`` on the same context (a second
    copy of the drafter's state, fed the same hidden states); ``check(step)`` first, if given."""
    M = committed.ids_M.shape[0]

    def compare(step, context):
        if check is not None:
            check(step)
        want = drafter.propose(context, M - 1, GREEDY)
        got = static.buffers
        assert got.tokens_T.tolist() == want.tokens.tolist(), f"step {step}: tokens differ from the eager propose"
        assert got.parents_T.tolist() == want.parents.tolist(), f"step {step}: parents differ from the eager propose"

    play_steps(target, drafter, static, committed, prompt_len, steps, step_fn, compare, shape)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_compiled_draft_is_one_graph_and_drafts_what_propose_does(target, kind):
    drafter, rows = KINDS[kind](target)
    committed = committed_for(drafter, rows)
    static = drafter.static_draft(committed, CAPACITY, GREEDY, None)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(static.draft, fullgraph=True, dynamic=False, backend="eager")

    def no_recompile_after_warmup(i):
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")

    try:
        for prompt_len in PROMPTS:
            play(drafter, static, committed, target, prompt_len, STEPS, step, no_recompile_after_warmup)
    finally:
        torch.compiler.set_stance("default")
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_draft_keeps_its_tensors_in_place_and_attention_shapes_bounded(target, kind):
    drafter, rows = KINDS[kind](target)
    committed = committed_for(drafter, rows)
    static = drafter.static_draft(committed, CAPACITY, GREEDY, None)
    named = tensors_of(static)  # its own state, its draft buffers and the committed buffers it reads
    assert {"state.buffers.tokens_T", "state.committed.ids_M"} <= set(named)
    before = layout(named)
    # What a step may read by address: its own state, the committed buffers, the weights (the drafter's and the
    # target's embedding and lm_head it borrows).
    known = {t.untyped_storage().data_ptr() for t in named.values()}
    known |= {t.untyped_storage().data_ptr() for t in (*drafter.parameters(), *drafter.buffers())}
    known |= {t.untyped_storage().data_ptr() for t in target.model.parameters()}
    recorders, buckets = [], []

    def recorded():
        with Recorder() as rec:
            static.draft()
        recorders.append(rec)

    def shape(step, context):
        """A shaped step (``use_shape``) alternates between its smallest bucket and the one for a full capacity (any
        bucket holding the context drafts the same): both keep every tensor in place and run the same ops."""
        buckets.append(static.use_shape(CAPACITY if step % 2 else context, False)[0])

    for prompt_len in PROMPTS:
        play(drafter, static, committed, target, prompt_len, 12, recorded,
             shape=shape if hasattr(static, "use_shape") else None)
    assert layout(named) == before
    # No step leaves a tensor of its own behind in the state (a prompt's eager prefill may keep its write positions;
    # the views of the column index per bucket share its storage).
    views = ("state.cache._positions", "state.cache._scratch", "state.cache._columns", "state.cache.columns")
    assert {k for k in tensors_of(static) if not k.startswith(views)} <= set(named)
    first = recorders[0].external
    for i, rec in enumerate(recorders):
        assert rec.external == first, f"step {i} touched other tensors than step 0"
        assert rec.ops == recorders[0].ops <= OP_BUDGET[kind]
    unknown = set(first) - known
    assert not unknown, f"a step reads {len(unknown)} tensor(s) outside its state, the committed buffers and weights"
    shapes = set().union(*(rec.attention for rec in recorders))
    assert len(shapes) <= ATTENTION_SHAPES[kind] * max(len(set(buckets)), 1), shapes
    assert bool(shapes) == bool(ATTENTION_SHAPES[kind])
    if buckets:  # each step's key length is its bucket, and both buckets ran
        assert len(set(buckets)) == 2, buckets
        assert [{k[-2] for _, k in rec.attention} for rec in recorders] == [{b} for b in buckets]


def test_eagle_static_draft_checks_its_buffers(target):
    drafter, _ = eagle(target, "eagle1", "dynamic", depth=4)
    with pytest.raises(ValueError, match="rows >= 2"):
        drafter.static_draft(committed_for(drafter, 1), CAPACITY, GREEDY, None)
    assert drafter.static_draft(committed_for(drafter, 3), CAPACITY, GREEDY, None).depth == 2  # clipped, as propose
    wrong = committed_for(drafter, 5)
    wrong.hidden_M = {2: wrong.hidden_M[-1]}
    with pytest.raises(ValueError, match="missing \\[-1\\]"):
        drafter.static_draft(wrong, CAPACITY, GREEDY, None)
    static = drafter.static_draft(committed_for(drafter, 5), 8, GREEDY, None)
    replay = Replay(target, (-1,), 9, 4)
    with pytest.raises(ValueError, match="capacity 8"):
        replay.prefill(static)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle1-dynamic", "medusa-tree", "draft-model"])
def test_draft_compiles_with_inductor(target, kind):
    drafter, rows = KINDS[kind](target)
    committed = committed_for(drafter, rows)
    static = drafter.static_draft(committed, CAPACITY, GREEDY, None)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(static.draft, fullgraph=True, dynamic=False)
    play(drafter, static, committed, target, PROMPTS[0], 8, step)
    assert counters["stats"]["unique_graphs"] == 1


def test_hashed_uniforms_are_uniform_and_fresh_per_step():
    seed = torch.tensor(12345)
    draws = torch.stack([hashed_uniforms(seed, torch.tensor(step), torch.arange(8)) for step in range(5000)])
    assert draws.min() >= 0 and draws.max() < 1
    histogram = torch.histc(draws.flatten(), bins=10, min=0, max=1) / draws.numel()
    assert (histogram - 0.1).abs().max() < 0.005, histogram  # 40k draws: a bin's sd is 0.0015
    flat = draws.flatten()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]) < 0.02  # neighbours uncorrelated
    other = torch.stack([hashed_uniforms(seed + 1, torch.tensor(step), torch.arange(8)) for step in range(5000)])
    assert (other != draws).float().mean() > 0.99  # another sequence's seed draws otherwise
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    picks = torch.stack([sample_uniform(probs, u[None]) for u in flat[:20000]]).flatten()
    freq = torch.bincount(picks, minlength=4) / picks.numel()
    assert freq[1] == 0 and (freq - probs).abs().max() < 0.012, freq  # sd <= 0.0036


def test_sampled_draft_model_chain_draws_from_its_warped_distributions(target):
    drafter, rows = draft_model(target)
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    committed = committed_for(drafter, rows)
    generator = torch.Generator().manual_seed(0)
    static = drafter.static_draft(committed, CAPACITY, sampling, generator)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(static.draft, fullgraph=True, dynamic=False, backend="eager")
    drafted = []
    for prompt_len in PROMPTS:
        replay = Replay(target, (), prompt_len, new_tokens=rows * 34 + 2, seed=prompt_len)
        replay.prefill(static)
        for i, count in enumerate(counts(34, rows, seed=prompt_len)):
            if i:
                replay.commit(committed, count)
            step()
            tokens, probs = static.buffers.tokens_T.clone(), static.buffers.probs_TV.clone()
            # The draft model's own distributions after the context and each earlier draft, warped as the target's.
            seq = torch.cat([replay.context()[0], tokens[:-1]])
            with torch.no_grad():
                logits = drafter.model(input_ids=seq[None]).logits[0, -tokens.shape[0]:]
            torch.testing.assert_close(probs, warp(logits, sampling), atol=1e-5, rtol=1e-5)
            assert (probs.gather(1, tokens[:, None]) > 0).all()  # each draft drawn from its own row
            drafted.append(tokens)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert len({tuple(t.tolist()) for t in drafted}) > len(drafted) // 2  # draws, not one fixed chain


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_decoding_through_the_static_draft_equals_plain_greedy(target, kind):
    """End to end: ``inference.decoder.Decoder`` at batch 1 drafts through the drafter's static step (counted here)
    and decodes the same tokens as plain greedy decoding."""
    drafter, rows = KINDS[kind](target)
    made = []
    build = drafter.static_draft

    def counted(*args, **kwargs):
        static = build(*args, **kwargs)
        if not hasattr(static, "calls"):
            draft, static.calls = static.draft, 0

            def run():
                static.calls += 1
                draft()

            static.draft = run
        made.append(static)
        return static

    drafter.static_draft = counted
    dec = Decoder(target)
    gen = torch.Generator().manual_seed(3)
    for prompt_len in PROMPTS:
        prompt = torch.randint(0, 128, (1, prompt_len), generator=gen)
        assert dec.speculative(drafter, prompt, 40, rows - 1).new_tokens == dec.plain(prompt, 40).new_tokens
    assert made and all(s is made[0] for s in made)  # one static draft (and one recorded step) for both prompts
    assert made[0].calls >= 2 * 8


def test_a_static_draft_is_made_once_per_buffers_and_settings(target):
    drafter, rows = eagle(target, "eagle1", "dynamic")
    committed = committed_for(drafter, rows)
    first = drafter.static_draft(committed, CAPACITY, GREEDY, None)
    assert drafter.static_draft(committed, CAPACITY, GREEDY, None) is first
    assert drafter.static_draft(committed, 2 * CAPACITY, GREEDY, None) is not first
    assert drafter.static_draft(committed_for(drafter, rows), CAPACITY, GREEDY, None) is not first
    drafter.set_tree("chain")
    assert drafter.static_draft(committed, CAPACITY, GREEDY, None).chain


def test_a_cast_drafter_gets_a_new_static_draft_and_still_decodes_losslessly(target):
    """A cast (``drafter.to``, as evaluation does to pick the faster dtype) reallocates the weights: the static draft
    built over the old ones (and any step recorded for it) must not be reused."""
    drafter, rows = medusa(target, "chain")
    committed = committed_for(drafter, rows)
    first = drafter.static_draft(committed, CAPACITY, GREEDY, None)
    drafter.to(torch.bfloat16)
    assert drafter.static_draft(committed, CAPACITY, GREEDY, None) is not first
    dec = Decoder(target)
    prompt = torch.randint(0, 128, (1, PROMPTS[0]), generator=torch.Generator().manual_seed(5))
    plain = dec.plain(prompt, 24).new_tokens
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        drafter.to(dtype)
        assert dec.speculative(drafter, prompt, 24, rows - 1).new_tokens == plain


def test_a_new_tree_budget_between_decodes_drafts_the_new_tree(target):
    """The decoder asks the drafter for its static draft at every sequence: a tree budget changed between decodes on
    one decoder (as the recipe benchmark decodes a chain, then trees) drafts the new tree, not the first one's."""
    drafter, rows = eagle(target, "eagle1", "dynamic")
    used = []
    build = drafter.static_draft
    drafter.static_draft = lambda *args, **kwargs: used.append(build(*args, **kwargs)) or used[-1]
    dec = Decoder(target)
    prompt = torch.randint(0, 128, (1, PROMPTS[0]), generator=torch.Generator().manual_seed(7))
    plain = dec.plain(prompt, 24).new_tokens
    assert dec.speculative(drafter, prompt, 24, rows - 1).new_tokens == plain
    assert dec.speculative(drafter, prompt, 24, rows - 1).new_tokens == plain
    drafter.set_tree("chain")
    assert dec.speculative(drafter, prompt, 24, rows - 1).new_tokens == plain
    assert not used[0].chain and used[1] is used[0] and used[-1].chain


def test_draft_model_shape_follows_the_context_and_its_own_draft(target):
    """``use_shape``: attention over the smallest capacity bucket holding the drafts, a 2-row catch-up after its
    own draft, M + 1 rows otherwise; past the capacity it refuses."""
    drafter, rows = draft_model(target)
    static = drafter.static_draft(committed_for(drafter, rows), 600, GREEDY, None)  # 600 + 6 + 4 columns
    assert static.use_shape(10, True) == (256, 2)
    assert static.use_shape(252, True) == (256, 2)  # drafts up to column 255
    assert static.use_shape(253, True) == (512, 2)
    assert static.use_shape(300, False) == (512, rows + 1)
    assert static.use_shape(600, True) == (610, 2)
    with pytest.raises(ValueError, match="more than the BatchKV capacity"):
        static.use_shape(607, True)


def test_a_static_draft_past_the_draft_models_positions_is_refused_as_the_eager_rows_refuse_it(target):
    """The draft model's own ``max_position_embeddings`` bounds its static draft too: ``use_shape`` (host, before
    each draft) refuses the draft that would run past it, with the settings to change, at the context where the
    eager proposal refuses it; a decode through the static step stops with that message."""
    drafter = DraftModel(DIMS, model=make_tiny_llama(num_hidden_layers=1, max_position_embeddings=16))
    drafter.bind_target(target, initialize=False)
    drafter.eval()
    static = drafter.static_draft(committed_for(drafter, 5), 32, GREEDY, None)  # γ = 4
    static.use_shape(12, True)  # the pending token at position 12: drafts fed up to position 15
    drafter.propose(torch.zeros(1, 13, dtype=torch.long), 4)  # the eager proposal on the same context: fits
    with pytest.raises(ValueError, match=r"max_position_embeddings=16.*eval.prompt_tokens"):
        static.use_shape(13, True)
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        drafter.propose(torch.zeros(1, 14, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        Decoder(target).speculative(drafter, torch.arange(1, 11)[None], 16, num_draft=4)


def test_decoder_drafts_with_a_two_row_catch_up_what_the_eager_proposal_drafts(target):
    """Through ``Decoder``: the draft model's static step, at the shapes the decoder picks (a 2-row catch-up, the
    key length a capacity bucket, never the whole buffer), accepts exactly what the eager proposal accepts at every
    step (the same drafts) and decodes plain greedy decoding's tokens."""
    drafter, rows = draft_model(target)
    shapes, attention = [], set()
    build = drafter.static_draft

    def recorded(*args, **kwargs):
        static = build(*args, **kwargs)
        if not hasattr(static, "recorded"):
            use_shape, draft, static.recorded = static.use_shape, static.draft, True
            static.use_shape = lambda *a: shapes.append(use_shape(*a)) or shapes[-1]

            def run():
                with Recorder() as rec:
                    draft()
                attention.update(rec.attention)

            static.draft = run
        return static

    dec = Decoder(target)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (1, n), generator=gen) for n in PROMPTS]
    drafter.static_draft = lambda *args, **kwargs: None  # the eager proposal, into the step's buffers
    eager = [dec.speculative(drafter, p, 48, rows - 1) for p in prompts]
    drafter.static_draft = recorded
    static = [dec.speculative(drafter, p, 48, rows - 1) for p in prompts]
    for p, e, s in zip(prompts, eager, static):
        assert s.new_tokens == e.new_tokens == dec.plain(p, 48).new_tokens
        assert dict(s.node_accepts) == dict(e.node_accepts) and s.nodes_per_forward == e.nodes_per_forward
    assert sum(e.nodes_per_forward.values()) < 48  # drafts were accepted: the catch-up fed accepted chains
    assert shapes and set(shapes) == {(256, 2)}
    assert {(q[-2], k[-2]) for q, k in attention} == {(2, 256), (1, 256)}


# EAGLE's static draft over a growing capacity bucket (``EagleStaticDraft.use_shape``): decodes whose context crosses
# the first bucket (256 columns) on a target with room for it.
EAGLE_KINDS = sorted(k for k in KINDS if k.startswith("eagle"))
LONG_PROMPTS = (236, 243)  # a bucket boundary within the first steps of each


@pytest.fixture(scope="module")
def long_target():
    return Teacher(make_tiny_llama(initializer_range=0.2, max_position_embeddings=1024), tokenizer=None,
                   name="tiny-llama-long")


def check_smallest_bucket(static, context: int, bucket: int) -> None:
    """``bucket`` is the smallest of the static draft's buckets holding the context and its S node slots."""
    need = context + static.ancestry.shape[1]
    assert bucket in static.buckets and bucket >= need, (context, bucket)
    assert all(b < need for b in static.buckets if b < bucket), (context, bucket, static.buckets)


def test_eagle_shape_follows_the_context(target):
    """``use_shape``: the smallest capacity bucket holding the context and the node slots behind it; past the
    capacity it refuses."""
    drafter, rows = eagle(target, "eagle1", "chain")
    static = drafter.static_draft(committed_for(drafter, rows), 600, GREEDY, None)  # 600 + 5 + 3 columns
    assert static.use_shape(10, True) == (256,)
    assert static.use_shape(253, True) == (256,)  # context columns 0 .. 252, node slots 253 .. 255
    assert static.use_shape(254, False) == (512,)
    assert static.use_shape(600, True) == (608,)
    with pytest.raises(ValueError, match="capacity >= 606"):
        static.use_shape(606, True)


def _with_peagle(kind, teacher):
    """An EAGLE kind's drafter and rows, or P-EAGLE's (two layers: its stacked layer's keys follow the bucket too)."""
    if kind != "peagle":
        return KINDS[kind](teacher)
    from tests.test_peagle import _static_drafter

    return _static_drafter(teacher, num_layers=2), 5


@pytest.mark.parametrize("kind", [*EAGLE_KINDS, "peagle"])
def test_eagle_draft_attends_over_a_growing_bucket_and_drafts_what_propose_does(long_target, kind):
    """Across the first bucket boundary, every step's attention keys are the bucket ``use_shape`` picked (the
    smallest holding the draft), the buckets grow with the context, and the drafts equal the eager ``propose``'s.
    P-EAGLE's step keeps EAGLE's layout (the context, then its parallel slots)."""
    drafter, rows = _with_peagle(kind, long_target)
    committed = committed_for(drafter, rows)
    static = drafter.static_draft(committed, 512, GREEDY, None)
    keys, buckets = [], []

    def shape(step, context):
        buckets.append(static.use_shape(context, True)[0])
        check_smallest_bucket(static, context, buckets[-1])

    def recorded():
        with Recorder() as rec:
            static.draft()
        keys.append({k[-2] for _, k in rec.attention})

    for prompt_len in LONG_PROMPTS:
        buckets.clear(), keys.clear()
        play(drafter, static, committed, long_target, prompt_len, 14, recorded, shape=shape)
        assert keys == [{b} for b in buckets]
        assert buckets == sorted(buckets) and set(buckets) == {256, 512}, buckets


def _decode_through(dec, teacher, drafter, prompts, new_tokens, rows, keys=None):
    """Decode each prompt ([1, P]) through ``dec`` (a ``BucketDecoder``: its one-row bucket) and assert plain greedy
    decoding's tokens; return the static draft and its (context, bucket) per step; with ``keys``, each draft step's
    attention key lengths too."""
    used, made = [], []
    build = drafter.static_draft

    def recorded(*args, **kwargs):
        static = build(*args, **kwargs)
        if not hasattr(static, "recorded"):  # wrapped once; each decode's lists go in ``recorded``
            use_shape, draft = static.use_shape, static.draft

            def shaped(context, own_draft):
                key = use_shape(context, own_draft)
                static.recorded[0].append((context, key[0]))
                return key

            def run():
                if static.recorded[1] is None:
                    return draft()
                with Recorder() as rec:
                    draft()
                static.recorded[1].append({k[-2] for _, k in rec.attention})

            static.use_shape, static.draft = shaped, run
        static.recorded = (used, keys)
        made.append(static)
        return static

    drafter.static_draft = recorded
    plain = Decoder(teacher)
    for prompt in prompts:
        got = dec.speculative(drafter, [prompt[0]], new_tokens, rows - 1).generations[0].new_tokens
        assert got == plain.plain(prompt, new_tokens).new_tokens
    drafter.static_draft = build
    assert made and all(s is made[0] for s in made)  # one static draft for every prompt
    return made[0], used


@pytest.mark.parametrize("kind", [*EAGLE_KINDS, "peagle"])
def test_decoder_drafts_eagle_over_growing_buckets_as_plain_greedy(long_target, kind):
    """Through the decoder at batch 1 (its one-row bucket): the EAGLE static draft's buckets grow across the
    boundary, each the smallest holding the draft, its attention keys are the bucket, and the tokens are plain greedy
    decoding's."""
    drafter, rows = _with_peagle(kind, long_target)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 128, (1, n), generator=gen) for n in LONG_PROMPTS]
    keys = []
    static, used = _decode_through(Decoder(long_target).batch, long_target, drafter, prompts, 40, rows, keys)
    assert len(keys) == len(used) >= 2 * 8
    assert keys == [{b} for _, b in used]
    for context, bucket in used:
        check_smallest_bucket(static, context, bucket)
    assert {b for _, b in used} == {256, 512}


# eagle3-chain (slow) repeats eagle1-chain's chain step and eagle3-dynamic's EAGLE-3 features and draft vocabulary.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "eagle3-chain" else k
                                  for k in [*EAGLE_KINDS, "peagle"]])
def test_eagle_draft_steps_compile_one_graph_per_bucket(long_target, kind):
    """Compiled (``fullgraph=True``) through the decoder at batch 1: one draft graph per bucket used, one verify graph
    for both buckets, none recompiled after a warm-up decode across the boundary, and plain greedy decoding's
    tokens."""
    drafter, rows = _with_peagle(kind, long_target)
    gen = torch.Generator().manual_seed(17)
    warm, *later = [torch.randint(0, 128, (1, n), generator=gen) for n in (*LONG_PROMPTS, 239)]
    torch._dynamo.reset()
    counters.clear()
    dec = BucketDecoder(long_target, generator=torch.Generator().manual_seed(0), cuda_graphs="off", compile=True,
                        compile_backend="eager")
    _, used = _decode_through(dec, long_target, drafter, [warm], 40, rows)
    drafts = sorted(k[3] for k in dec._fns if k[1] == "draft")
    assert drafts == [(256,), (512,)] and {b for _, b in used} == {256, 512}
    graphs = counters["stats"]["unique_graphs"]
    compiled = {id(compiled_of(f)) for f in dec._fns.values()}  # a verify step's buckets share one compilation
    assert graphs == len(compiled) == len(dec._fns) - 1 and not counters["graph_break"], dict(counters["graph_break"])
    with torch.compiler.set_stance("fail_on_recompile"):
        _, used = _decode_through(dec, long_target, drafter, later, 40, rows)
    assert {b for _, b in used} == {256, 512}
    assert counters["stats"]["unique_graphs"] == graphs
    assert sorted(k[3] for k in dec._fns if k[1] == "draft") == drafts
