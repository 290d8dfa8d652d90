"""Batch 1 as the decoder runs it: the one-row bucket of the batched steps (inference.batch_decoder's
``BucketDecoder``, inference.batch_steps, inference.batch_cache, inference.runner), what makes its steps recordable as
CUDA graphs, checked on the CPU.

- every step function compiles with ``torch.compile(fullgraph=True, dynamic=False)`` (no graph break), and a decode
  of >= 64 steps over two prompt lengths with varying accepted lengths makes one graph per bucket used and no
  recompile after warm-up (``set_stance("fail_on_recompile")``): plain, lookup, a static drafter;
- every tensor a step reads or writes keeps its address, shape and stride for the whole decode;
- the distinct attention (query, key) shapes of the steps are at most the buckets used;
- greedy output token-identical to plain decoding and to the one-row bucket drafting through the drafter's eager rows,
  for every drafter kind;
- one read-back per step, and the host's own ops outside the steps bounded.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from heads.base import TargetDims
from inference.batch_decoder import BucketDecoder
from inference.batch_steps import BatchSteps, Bucket
from inference.decoder import Decoder, DecoderConfig
from inference.runner import resolve_compile, resolve_graphs
from inference.sampling import GREEDY, SamplingConfig
from inference.batch_cache import BatchKV, capacity_buckets, kv_shapes
from inference.static_draft import DraftBuffers
from inference.transfers import TransferCounter
from inference.tree import DraftTree
from tests.drafters import eager_proposals
from tests.test_decoder_transfers import make

GAMMA = 3


class TableDrafter:
    """A drafter with a static step: after token x it drafts the target's own greedy continuation of the lone token
    x (right in some contexts, wrong in others: varying accepted lengths). ``propose`` drafts the same on the eager
    path, so both paths can be compared."""

    name = "table"
    teacher_layers: tuple[int, ...] = ()
    dynamic_tree = False
    tree = None

    def __init__(self, teacher, gamma: int = GAMMA, spoil: bool = True, context=None):
        V = teacher.vocab_size
        self.dims = TargetDims(teacher.hidden_size, V, teacher.num_layers)
        ids = torch.arange(V, device=teacher.device).view(V, 1)
        if context is not None:  # continuations of context + x instead of the lone x
            ids = torch.cat([context.to(teacher.device).expand(V, -1), ids], 1)
        with torch.no_grad():
            for _ in range(gamma):
                ids = torch.cat([ids, teacher.model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        self.table = ids[:, -gamma:].contiguous()  # [V, γ]
        self.gamma, self.spoil = gamma, spoil
        self.steps = 0

    # the eager protocol
    def observe(self, hidden) -> None: ...

    def reset(self, seed: int = 0) -> None:
        self.steps = 0

    def accepted(self, path, committed=None) -> None:
        self.steps += 1

    def _spoil(self, chain, step):
        """From node ``step % (γ + 1)`` on, a token the target did not predict: accepted lengths vary."""
        wrong = (torch.arange(self.gamma, device=chain.device) >= step % (self.gamma + 1)) & self.spoil
        return torch.where(wrong, (chain + 1) % self.dims.vocab_size, chain)

    def propose(self, tokens, max_depth, sampling):
        return DraftTree.chain(self._spoil(self.table[int(tokens[0, -1])], self.steps)[:max_depth])

    def set_tree(self, spec) -> None: ...

    def rows(self, seeds):
        drafter = self

        drafter.reset()

        class Rows:
            def observe(self, row, hidden): ...

            def accepted(self, row, path, committed=None):
                drafter.accepted(path, committed)

            def keep(self, rows): ...

            def propose(self, tokens, depths, samplings):
                return [drafter.propose(t, d, s) for t, d, s in zip(tokens, depths, samplings)]

        return Rows()

    # the static step
    def static_draft(self, committed, capacity, sampling, generator):
        """One per buffers, as a drafter's ``reuse_static_draft`` keeps them (the decoder asks at every sequence)."""
        made = self.__dict__.setdefault("_made", {})
        key = (id(committed), capacity, sampling)
        if key not in made:
            made[key] = self._static_draft(committed)
        return made[key]

    def _static_draft(self, committed):
        drafter = self

        class Static:
            """Its state in tensors the instance holds (a row of a batch bucket points them at its own)."""

            def __init__(self):
                device = drafter.table.device
                self.buffers = DraftBuffers(tokens_T=torch.zeros(drafter.gamma, dtype=torch.long, device=device),
                                            parents_T=torch.arange(-1, drafter.gamma - 1, device=device), chain=True)
                self.step = torch.zeros((), dtype=torch.long, device=device)

            def prefill(self, prompt_ids_P, hidden_P, pending):
                self.step.zero_()

            def draft(self):
                chain = drafter.table.index_select(0, committed.pending.view(1))[0]
                self.buffers.tokens_T.copy_(drafter._spoil(chain, self.step))
                self.step.add_(1)

        return Static()


def prompts(lengths=(11, 37, 23), seed=2):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        p = torch.randint(0, 128, (1, n), generator=gen)
        out.append(torch.cat([p, p[:, :8], p[:, :8]], 1))  # something for lookup to find
    return out


def one_row(teacher, sampling=GREEDY, seed=0, **kw):
    """A decoder whose single prompts run in the one-row bucket, with its own generator (steps as they are unless
    ``kw`` says otherwise; a drafter with a static draft drafts through it)."""
    kw = {"cuda_graphs": "off", "compile": "off", **kw}
    return BucketDecoder(teacher, sampling=sampling, generator=torch.Generator().manual_seed(seed), **kw)


def compiled(teacher, sampling=GREEDY, seed=0, **kw):
    return one_row(teacher, sampling, seed, compile=True, compile_backend="eager", **kw)


def drafter_for(kind, teacher):
    return TableDrafter(teacher) if kind == "table" else make(kind, teacher)


def single(out):
    """The one prompt's ``Generation`` of a one-row decode, with the decode's times (as ``Decoder`` reports it)."""
    (gen,) = out.generations
    gen.seconds, gen.prefill_seconds = out.seconds, out.prefill_seconds
    gen.draft_seconds, gen.verify_seconds, gen.compile_seconds = out.draft_seconds, out.verify_seconds, \
        out.compile_seconds
    return gen


def decode(dec, kind, drafter, prompt, n):
    """``prompt`` [1, P] through ``dec`` (a ``BucketDecoder``: its one-row bucket; or a ``Decoder``)."""
    if isinstance(dec, Decoder):
        return dec.plain(prompt, n) if kind == "plain" else dec.speculative(drafter, prompt, n, num_draft=GAMMA)
    out = dec.plain([prompt[0]], n) if kind == "plain" else dec.speculative(drafter, [prompt[0]], n, GAMMA)
    return single(out)


def static_steps(dec) -> bool:
    """Whether ``dec`` (a ``BucketDecoder``) ran a drafter's static draft step."""
    return any(k[1] == "draft" for k in dec._fns)


# Drafters whose static step drafts a tree: near the end of a decode it is clipped in place (nodes deeper than the
# tokens left never accepted, its bucket unchanged), where the eager loop proposes a smaller tree.
STATIC_TREES = ("table", "medusa_tree", "eagle1_dynamic", "eagle3_dynamic")


@pytest.mark.parametrize("kind", ["plain", "lookup", "table", "draft_model"])
def test_one_graph_per_bucket_and_no_recompile(tiny_teacher, kind):
    torch._dynamo.reset()
    counters.clear()
    dec, ref = compiled(tiny_teacher), Decoder(tiny_teacher)
    drafter = drafter_for(kind, tiny_teacher)
    short, long, third = prompts()
    decode(dec, kind, drafter, short, 8)  # warm-up: records the bucket
    graphs = counters["stats"]["unique_graphs"]
    # the prefill's bucket (prompts of every length below 256 share it), the step bucket (and a static drafter's
    # draft step)
    expected = 2 if kind in ("plain", "lookup") else 3
    assert graphs == expected and not counters["graph_break"], (graphs, dict(counters["graph_break"]))
    steps, accepted = 0, set()
    with torch.compiler.set_stance("fail_on_recompile"):
        for prompt in (short, long, third):
            out = decode(dec, kind, drafter, prompt, 110)
            assert out.new_tokens == ref.plain_eager(prompt, 110).new_tokens
            steps += sum(out.nodes_per_forward.values()) if kind != "plain" else 109
            for row in out.stats.counts.values():
                accepted.update(row)
    assert steps >= 64
    assert kind == "plain" or len(accepted) >= 2, f"accepted lengths did not vary: {accepted}"
    assert counters["stats"]["unique_graphs"] == graphs


# The verify steps see only the proposal's shape: eagle3_chain and draft_model (slow) propose chains padded to γ, the
# buckets medusa_chain's chains already compile.
@pytest.mark.parametrize("kind", ["medusa_chain", "medusa_tree", "eagle1_dynamic",
                                  pytest.param("eagle3_chain", marks=pytest.mark.slow),
                                  pytest.param("draft_model", marks=pytest.mark.slow)])
def test_eager_drafters_verify_steps_compile_one_graph_per_bucket(tiny_teacher, kind):
    """Drafters proposing eagerly (``eager_proposals``; their static steps are theirs to test): every verify bucket
    their proposals use (chains padded to γ; trees rounded up to multiples of 8, smaller near the end) is one graph,
    token-identical."""
    torch._dynamo.reset()
    counters.clear()
    dec, ref = compiled(tiny_teacher), Decoder(tiny_teacher)
    drafter = make(kind, tiny_teacher)
    for prompt in prompts()[:2]:
        with eager_proposals(drafter):
            assert decode(dec, kind, drafter, prompt, 24).new_tokens == ref.plain_eager(prompt, 24).new_tokens
    assert not counters["graph_break"] and not static_steps(dec)
    assert counters["stats"]["unique_graphs"] == len(dec._fns) <= 4, [k[1] for k in dec._fns]  # prefill + <= 3


class Shapes:
    """The (query, key) lengths of every attention call (the SDPA function Hugging Face's attention calls)."""

    def __init__(self, monkeypatch):
        self.seen, self.on = set(), False
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def watched(q, k, *args, **kwargs):
            if self.on:
                self.seen.add((q.shape[-2], k.shape[-2]))
            return sdpa(q, k, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", watched)


def _watch(dec: BucketDecoder, state: BatchSteps):
    """Address, shape and stride of every buffer a step reads or writes: the one-row state's, and a static draft
    step's own state at its rows."""
    drafts = [t for d in dec._drafts.values() if d.state is state for t in d.stacked]
    return {i: (t.data_ptr(), tuple(t.shape), t.stride()) for i, t in enumerate([*state.buffers(), *drafts])}


@pytest.mark.parametrize("kind", ["plain", "lookup", "table", "medusa_tree"])
def test_buffers_keep_their_addresses_and_attention_shapes_are_the_buckets(tiny_teacher, kind, monkeypatch):
    dec = one_row(tiny_teacher)
    drafter = drafter_for(kind, tiny_teacher)
    short, long, _ = prompts()
    decode(dec, kind, drafter, short, 4)
    (steps,) = dec._states.values()
    assert steps.R == 1 and static_steps(dec) == (kind in ("table", "medusa_tree"))
    before = _watch(dec, steps)
    buckets, shapes = set(), Shapes(monkeypatch)
    original = dec._step

    def step(s, bucket, sampling):
        buckets.add(bucket)
        assert _watch(dec, s) == before
        shapes.on = True
        original(s, bucket, sampling)
        shapes.on = False
        assert _watch(dec, s) == before

    monkeypatch.setattr(dec, "_step", step)
    for prompt in (short, long):
        decode(dec, kind, drafter, prompt, 40)
    assert _watch(dec, steps) == before
    assert shapes.seen and {(b.width, b.columns) for b in buckets} == shapes.seen, (buckets, shapes.seen)


@pytest.mark.parametrize("kind", ["medusa_chain", "medusa_tree", "eagle1_chain", "eagle1_dynamic", "eagle3_chain",
                                  "eagle3_dynamic", "draft_model", "lookup", "table"])
def test_greedy_step_path_is_token_identical(tiny_teacher, kind):
    """``Decoder``'s one-row bucket (a drafter's static draft step where it has one) gives plain greedy decoding's
    tokens, and the accepted lengths of the same bucket drafting through the drafter's eager ``propose``."""
    decoder = Decoder(tiny_teacher, DecoderConfig(seed=1))
    rows = BucketDecoder(tiny_teacher, seed=1)
    drafter = drafter_for(kind, tiny_teacher)
    for prompt in prompts()[:2]:
        ref = decoder.plain_eager(prompt, 30).new_tokens
        assert decoder.plain(prompt, 30).new_tokens == ref
        out = decoder.speculative(drafter, prompt, 30, num_draft=GAMMA)
        with eager_proposals(drafter):
            eager = decode(rows, kind, drafter, prompt, 30)
        assert out.new_tokens == eager.new_tokens == ref
        if kind not in STATIC_TREES:  # a static tree keeps its width to the end (the eager one shrinks)
            assert out.stats.counts == eager.stats.counts
            assert dict(out.nodes_per_forward) == dict(eager.nodes_per_forward)
    assert static_steps(decoder.batch) == (kind != "lookup"), list(decoder.batch._fns)  # the static draft step ran
    assert not static_steps(rows)


class HostOps(TorchDispatchMode):
    """Aten ops (views excluded) outside the step functions."""

    def __init__(self):
        super().__init__()
        self.inside = False
        self.outside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and not func.is_view:
            self.outside += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8)], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("kind", ["plain", "table", "lookup"])
def test_one_read_back_and_few_host_ops_per_step(tiny_teacher, kind, sampling, monkeypatch):
    """The verdict read back once per step, nothing synced inside a step (the verify or plain step, and a static
    drafter's draft step, each a step function the decoder compiles or records), and the host's own ops outside
    them bounded."""
    dec = one_row(tiny_teacher, sampling)
    drafter = drafter_for(kind, tiny_teacher)
    prompt = prompts()[0]
    decode(dec, kind, drafter, prompt, 8)
    assert static_steps(dec) == (kind == "table")
    ops, calls = HostOps(), []

    def inside_a_step(run):
        ops.inside = True
        try:
            with TransferCounter() as inside:
                run()
        finally:
            ops.inside = False
        assert inside.total == 0, dict(inside.counts)  # nothing syncs inside a step

    original, original_draft = dec._step, dec._draft_step

    def step(s, bucket, sampling):
        calls.append(bucket)
        inside_a_step(lambda: original(s, bucket, sampling))

    def draft_step(static, shape):
        fn = original_draft(static, shape)
        return lambda: inside_a_step(fn)

    monkeypatch.setattr(dec, "_step", step)
    monkeypatch.setattr(dec, "_draft_step", draft_step)
    totals = []
    for n in (10, 50):
        calls.clear()
        ops.outside = 0
        with TransferCounter() as c, ops:
            decode(dec, kind, drafter, prompt, n)
        totals.append((c.counts["item"] + c.counts["tolist"], ops.outside, len(calls)))
    (r0, o0, s0), (r1, o1, s1) = totals
    assert s1 > s0 + 5
    assert (r1 - r0) / (s1 - s0) <= 1.0, totals  # the verdict, read back once per step
    host_ops = (o1 - o0) / (s1 - s0)
    print(f"HOST OPS {kind} {sampling.describe()}: {host_ops:.1f} per step")
    assert host_ops <= 20, totals


def test_static_cache_decodes_like_the_models_own_cache(tiny_teacher):
    """The model's own forward over the one-row static cache (the prompt's own columns, and a whole capacity bucket
    under the mask) gives the logits it gives over a DynamicCache."""
    model = tiny_teacher.model
    cache = BatchKV(kv_shapes(model), 1, 300, "cpu")
    assert capacity_buckets(300) == [256, 300] and cache.use_bucket(257) == 300
    steps = BatchSteps(model, Decoder(tiny_teacher).layout, 1, 256, 128, {}, 0, 1, kv_shapes(model))
    prompt = prompts()[0][0]
    with torch.no_grad():
        ref = model(prompt[None]).logits[0, -1]
        logits, _ = steps.prefill([prompt])
        torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)
        B = steps.load_prompts([prompt])
        assert B == 256
        steps.prefill_bucket(B)
    torch.testing.assert_close(steps.first_logits[0], ref, rtol=1e-4, atol=1e-4)
    assert steps.cache.host_lengths == [prompt.shape[0]] and int(steps.cache.length[0]) == prompt.shape[0]
    with pytest.raises(ValueError, match="capacity"):
        cache.use_bucket(301)
    with pytest.raises(ValueError, match="capacity"):
        steps.cache.use_bucket(257)


def test_step_clock_reads_cuda_events_once_after_the_decode(monkeypatch):
    """On CUDA the draft / verify split comes from events read after the decode (no sync between a step's draft and
    its verification); on a CPU from the host clock. Fake events stand in for CUDA's."""
    from inference.runner import StepClock

    made = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at, self.read = None, 0
            made.append(self)

        def record(self):
            self.at = 10.0 * len(made)  # ms: 10, 20, 30, ...

        def elapsed_time(self, end):
            self.read += 1
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = StepClock(torch.device("cuda"))
    for _ in range(3):
        start, drafted = clock.mark(), clock.mark()
        clock.step(start, drafted, clock.mark())
    assert all(e.read == 0 for e in made)  # nothing read while decoding
    steps = clock.steps()
    assert steps == [pytest.approx((0.01, 0.01))] * 3  # 10 ms each
    assert (sum(d for d, _ in steps), sum(v for _, v in steps)) == pytest.approx((0.03, 0.03))  # 3 steps
    assert sum(e.read for e in made) == 2 * 3  # each step's two spans, read once, after the decode
    cpu = StepClock(torch.device("cpu"))
    cpu.step(1.0, 1.5, 3.0)
    assert cpu.steps() == [(0.5, 1.5)]


def test_cuda_graphs_key_is_checked():
    assert resolve_graphs("auto", torch.device("cpu")) is False
    assert resolve_graphs("off", torch.device("cuda")) is False
    assert resolve_graphs("auto", torch.device("cuda")) is True
    with pytest.raises(ValueError, match="decoder.cuda_graphs=on needs a CUDA target"):
        resolve_graphs("on", torch.device("cpu"))
    with pytest.raises(ValueError, match="valid"):
        resolve_graphs("yes", torch.device("cpu"))


def test_compile_key_is_checked():
    """decoder.compile: auto compiles on CUDA only; on / off (and true / false, as Hydra passes them) everywhere."""
    assert resolve_compile("auto", torch.device("cuda")) is True
    assert resolve_compile("auto", torch.device("cpu")) is False
    assert resolve_compile("off", torch.device("cuda")) is False
    assert resolve_compile("on", torch.device("cpu")) is True
    assert resolve_compile(True, torch.device("cpu")) is True and resolve_compile("True", torch.device("cpu")) is True
    assert resolve_compile("false", torch.device("cuda")) is False
    assert resolve_compile(False, torch.device("cuda")) is False
    with pytest.raises(ValueError, match="decoder.compile='sometimes'; valid"):
        resolve_compile("sometimes", torch.device("cpu"))
    assert DecoderConfig().compile == "auto"


def test_compilation_is_left_out_of_decode_times_and_reported(tiny_teacher):
    """A step's first call compiles it (here: a backend that takes 0.4 s per graph). That time is the report's
    compile_seconds, not decode time: the decode that compiles takes as long as the next one, which compiles
    nothing."""
    import time

    def slow(gm, example_inputs):
        time.sleep(0.4)
        return gm.forward

    torch._dynamo.reset()
    dec = one_row(tiny_teacher, compile="on", compile_backend=slow)
    prompt, drafter = prompts()[0], TableDrafter(tiny_teacher)
    first, second = decode(dec, "plain", None, prompt, 20), decode(dec, "plain", None, prompt, 20)
    assert first.compile_seconds >= 0.8 and second.compile_seconds == 0  # the prefill's step and the plain step
    assert first.seconds < 0.4 + 2 * second.seconds, (first.seconds, second.seconds)
    spec = decode(dec, "table", drafter, prompt, 20)
    assert spec.compile_seconds >= 0.8 and static_steps(dec)  # its draft step and its verify step
    assert spec.seconds < 0.4 and spec.draft_seconds < 0.4 and spec.verify_seconds < 0.4, spec
    assert spec.draft_seconds > 0 and spec.verify_seconds > 0
    described = dec.describe()
    assert described["compiled_steps"] == len(dec._fns) >= 4, list(dec._fns)  # each compiled once
    assert described["compile_seconds"] == pytest.approx(first.compile_seconds + spec.compile_seconds, abs=1e-3)
    assert first.new_tokens == second.new_tokens == Decoder(tiny_teacher).plain_eager(prompt, 20).new_tokens


def test_sampled_siblings_repeating_a_token_are_refused():
    from tests.host_acceptance import refuse_repeated_sampled_siblings

    q = torch.full((3, 5), 0.2)
    refuse_repeated_sampled_siblings(DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]), q))
    with pytest.raises(ValueError, match="without replacement"):
        refuse_repeated_sampled_siblings(DraftTree(torch.tensor([1, 1, 3]), torch.tensor([-1, -1, 0]), q))
    refuse_repeated_sampled_siblings(DraftTree(torch.tensor([1, 1, 3]), torch.tensor([-1, -1, 0])))  # point masses


class _FakeCuda:
    """Enough of torch.cuda for the recording logic to run on a CPU: streams are no-ops and a recording fails."""

    class Stream:
        def __init__(self, *a, **k): ...

        def wait_stream(self, other): ...

    @staticmethod
    def stream(s):
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None):
        return _FakeCuda.Stream()

    class CUDAGraph:
        def replay(self):
            raise AssertionError("a failed recording must not be replayed")

    @staticmethod
    def graph_pool_handle():
        return object()

    @staticmethod
    def graph(g, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_compilation_falls_back_to_the_step_as_it_is_and_says_why(tiny_teacher):
    """decoder.compile with a backend that cannot compile: every step runs uncompiled, token-identically, and the
    decoder says why."""

    def broken(gm, example_inputs):
        raise RuntimeError("no kernels for this step")

    dec = one_row(tiny_teacher, compile=True, compile_backend=broken)
    ref = Decoder(tiny_teacher)
    prompt = prompts()[0]
    drafter = TableDrafter(tiny_teacher)
    assert decode(dec, "plain", None, prompt, 20).new_tokens == ref.plain_eager(prompt, 20).new_tokens
    assert decode(dec, "table", drafter, prompt, 20).new_tokens == ref.plain_eager(prompt, 20).new_tokens
    assert static_steps(dec) and "no kernels for this step" in dec.fallback_reason
    assert dec.describe()["fallback_reason"] == dec.fallback_reason


def test_a_failed_recording_falls_back_to_the_eager_step_and_says_why(tiny_teacher, monkeypatch):
    """Every step the one-row bucket records (plain, a static draft step, verify) falls back to the step as it is
    when its recording fails, token-identically, and the decoder says why."""
    dec = Decoder(tiny_teacher)
    dec.runner.graphs = True  # as on CUDA; the recording below fails
    for name in ("Stream", "stream", "current_stream", "CUDAGraph", "graph_pool_handle", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(_FakeCuda, name))
    drafter = TableDrafter(tiny_teacher)
    prompt = prompts()[0]
    ref = dec.plain_eager(prompt, 20).new_tokens
    assert dec.plain(prompt, 20).new_tokens == ref
    assert "operation not permitted" in dec.runner.fallback_reason
    dec.runner.fallback_reason = None
    assert dec.speculative(drafter, prompt, 20, num_draft=GAMMA).new_tokens == ref
    assert "operation not permitted" in dec.runner.fallback_reason and static_steps(dec.batch)
    assert dec.batch.describe()["fallback_reason"] == dec.runner.fallback_reason


def test_cost_model_times_the_step_that_runs_on_a_moving_context(tiny_teacher, monkeypatch):
    """``measure_steps`` times the decoder's own one-row steps, and no two timed verifications see the same
    context."""
    from inference.session import Session
    from inference.cost import measure_steps

    contexts, plain_contexts, original, original_plain = [], [], Session.verify, Session.plain_step
    plain = []  # inside a plain step (which runs its own verification of nothing drafted)

    def verify(self):
        assert self.batch.state.R == 1
        if not plain:
            contexts.append(self.batch.state.cache.host_lengths[0])
        return original(self)

    def plain_step(self):
        plain_contexts.append(self.batch.state.cache.host_lengths[0])
        plain.append(True)
        try:
            return original_plain(self)
        finally:
            plain.pop()

    monkeypatch.setattr(Session, "verify", verify)
    monkeypatch.setattr(Session, "plain_step", plain_step)
    drafter = make("medusa_tree", tiny_teacher)
    shapes = {3: torch.tensor([-1, 0, 0]), 2: torch.tensor([-1, 0])}
    parts = measure_steps(Decoder(tiny_teacher), drafter, prompts()[0], [1, 3], shapes, repeats=3, max_new_tokens=150)
    assert set(parts["t_verify_measured"]) == {0, 2, 3} and set(parts["t_draft"]) == {1, 3}
    assert all(t > 0 for t in [parts["t_plain"], parts["t_prefill"], *parts["t_draft"].values()])
    assert len(contexts) == 4 * (3 + 2) and len(set(contexts)) == len(contexts), contexts  # always moving
    assert len(plain_contexts) == 4 and len(set(plain_contexts)) == 4, plain_contexts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by the GPU recipe)")
def test_cuda_graphs_replay_token_identically_on_cuda():
    from distill.teacher import Teacher
    from inference.runner import _Recorded
    from tests.conftest import make_tiny_llama

    teacher = Teacher(make_tiny_llama().cuda(), tokenizer=None, name="tiny-cuda")
    # the default on CUDA (compiled steps under graphs), graphs over eager steps, eager steps
    default = Decoder(teacher)
    graphed = Decoder(teacher, DecoderConfig(compile="off"))
    eager = Decoder(teacher, DecoderConfig(cuda_graphs="off", compile="off"))
    assert default.runner.graphs and default.runner.compile and graphed.runner.graphs and not graphed.runner.compile
    assert not eager.runner.graphs and not eager.runner.compile
    drafters = {"table": TableDrafter(teacher), "lookup": make("lookup", teacher),
                "medusa_tree": make("medusa_tree", teacher).cuda()}
    for prompt in prompts()[:2]:
        ref = eager.plain_eager(prompt, 40).new_tokens
        for dec in (graphed, default):
            assert dec.plain(prompt, 40).new_tokens == eager.plain(prompt, 40).new_tokens == ref
            for name, drafter in drafters.items():
                assert dec.speculative(drafter, prompt, 40, num_draft=GAMMA).new_tokens == ref, name
    for dec in (graphed, default):
        assert dec.runner.fallback_reason is None and static_steps(dec.batch)
        assert all(state.R == 1 for state in dec.batch._states.values())
        assert any(isinstance(f, _Recorded) and f.graph is not None for f in dec.batch._fns.values())
    assert default.batch.describe()["compiled_steps"] > 0


# table (slow): the sampled verify step plain decoding takes too, through a static tree
@pytest.mark.parametrize("kind", ["plain", pytest.param("table", marks=pytest.mark.slow)])
def test_sampling_through_the_steps_is_distributed_as_the_target(kind):
    """Temperature 1 on a 4-token vocabulary: 3 new tokens drawn 3000 times through the step path (plain steps'
    inverse-CDF draws, and a static drafter's point-mass chain under rejection sampling) match the exact joint."""
    from distill.teacher import Teacher
    from tests.test_lossless_sampling import LENGTH, _exact_continuations, _tiny, tv

    teacher = Teacher(_tiny(0), tokenizer=None, name="tiny-v4")
    prompt = torch.tensor([[1, 2, 3]])
    exact = _exact_continuations(teacher.model, prompt, LENGTH)
    decoder = Decoder(teacher, DecoderConfig(temperature=1.0, seed=0))
    drafter = TableDrafter(teacher, gamma=2, spoil=False, context=prompt)
    samples, counts, accepted = 3000, torch.zeros_like(exact), 0
    for _ in range(samples):
        if kind == "plain":
            gen = decoder.plain(prompt, LENGTH)
        else:
            gen = decoder.speculative(drafter, prompt, LENGTH, num_draft=2)
        counts[tuple(gen.new_tokens)] += 1
        accepted += sum(a * c for row in gen.stats.counts.values() for a, c in row.items())
    assert kind == "plain" or (accepted > samples // 10 and static_steps(decoder.batch))
    tol = 2 * 0.5 * float(torch.sqrt(2 * exact * (1 - exact) / (torch.pi * samples)).sum())
    assert tv(counts / samples, exact) < tol


def test_a_longer_decode_moves_to_a_larger_cache_and_its_buckets():
    """Past the first capacity bucket (256 columns) attention reads the next one; a decode needing more than the
    cache holds gets a larger cache (and the old one's recorded steps are dropped), token-identically."""
    from distill.teacher import Teacher
    from tests.conftest import make_tiny_llama

    dec = Decoder(Teacher(make_tiny_llama(max_position_embeddings=1024), tokenizer=None, name="tiny-1024"))
    dec.runner.static_prefill = True  # as where steps are compiled or recorded: attention reads capacity buckets
    short = prompts()[0]
    assert dec.plain(short, 10).new_tokens == dec.plain_eager(short, 10).new_tokens
    (small,) = dec.batch._states.values()
    assert small.cache.capacity == 256 and small.R == 1
    long = torch.randint(0, 128, (1, 230), generator=torch.Generator().manual_seed(5))
    buckets = set()
    original = dec.batch._step
    dec.batch._step = lambda s, bucket, sampling: (buckets.add(bucket.columns), original(s, bucket, sampling))
    assert dec.plain(long, 50).new_tokens == dec.plain_eager(long, 50).new_tokens
    (large,) = dec.batch._states.values()
    assert large is not small and large.cache.capacity == 512 and buckets == {256, 512}
    assert all(k[0] == id(large) for k in dec.batch._fns)


class TreeTableDrafter(TableDrafter):
    """``TableDrafter`` (never spoiled: its chain is always accepted) with a static step that drafts a tree: the
    chain, and beside each chain node a sibling the target never predicts."""

    def __init__(self, teacher, gamma: int = GAMMA):
        super().__init__(teacher, gamma, spoil=False)

    def static_draft(self, committed, capacity, sampling, generator):
        drafter, g = self, self.gamma
        chain_parents = torch.arange(-1, g - 1)

        class Static:
            def __init__(self):
                self.buffers = DraftBuffers(tokens_T=torch.zeros(2 * g, dtype=torch.long),
                                            parents_T=torch.cat([chain_parents, chain_parents]), chain=False)

            def prefill(self, prompt_ids_P, hidden_P, pending):
                ...

            def draft(self):
                chain = drafter.table.index_select(0, committed.pending.view(1))[0]
                self.buffers.tokens_T.copy_(torch.cat([chain, (chain + 1) % drafter.dims.vocab_size]))

        return Static()


def test_clip_tree_drops_exactly_the_nodes_deeper_than_asked():
    from inference.static_draft import clip_tree

    parents = torch.tensor([-1, -1, 0, 2, 1, -1])  # depths 1, 1, 2, 3, 2, and a padding node
    for depth, kept in ((1, [10, 11, -1, -1, -1, -1]), (2, [10, 11, 12, -1, 14, -1]), (3, [10, 11, 12, 13, 14, -1])):
        buffers = DraftBuffers(tokens_T=torch.tensor([10, 11, 12, 13, 14, -1]), parents_T=parents.clone())
        clip_tree(buffers, depth)
        assert buffers.tokens_T.tolist() == kept, depth
        assert buffers.parents_T.tolist() == parents.tolist()


@pytest.mark.parametrize("max_new", [7, 8, 9, 10])
def test_a_static_tree_accepts_no_more_than_the_tokens_left(tiny_teacher, max_new):
    """A tree whose chain is always accepted, at every remainder of max_new over the step's γ + 1 tokens: the last
    step accepts no deeper than the tokens still needed, and the output is exactly max_new tokens, as plain's."""
    dec = Decoder(tiny_teacher)
    drafter = TreeTableDrafter(tiny_teacher)
    prompt = prompts()[0]
    gen = dec.speculative(drafter, prompt, max_new, num_draft=GAMMA)
    assert gen.new_tokens == dec.plain(prompt, max_new).new_tokens and len(gen.new_tokens) == max_new
    committed = sum((a + 1) * c for row in gen.stats.counts.values() for a, c in row.items())
    assert committed <= max_new, dict(gen.stats.counts)  # + the prefill's token: at most one past max_new
    assert set(gen.nodes_per_forward) == {2 * GAMMA}  # clipped in place: the tree's one bucket throughout
    assert static_steps(dec.batch)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8)], ids=["greedy", "t0.8"])
def test_a_chain_step_attends_and_commits_as_the_tree_step_of_its_chain(tiny_teacher, sampling, monkeypatch):
    """A chain's verify step builds its mask and positions straight from the context length; they, its verdict, the
    committed rows it hands the drafter and the cache length equal the general tree step's on the same chain."""
    model = tiny_teacher.model
    steps = BatchSteps(model, Decoder(tiny_teacher).layout, 1, 256, tiny_teacher.vocab_size, {-1: -1}, 8, 1 + GAMMA,
                       kv_shapes(model), probs=not sampling.greedy, max_chain=GAMMA)
    prompt = prompts()[1][0]
    seen = []
    forward = steps._forward
    monkeypatch.setattr(steps, "_forward", lambda *a: (seen.append([t.clone() for t in a[:4]]), forward(*a))[1])
    with torch.no_grad():
        ref = model(prompt[None]).logits[0, -1].argmax()
    results = []
    for chain in (True, False):
        with torch.no_grad():
            steps.prefill([prompt])
        steps.pending.fill_(int(ref))
        steps.uniforms.fill_(1e-4)  # sampling: the drafted nodes kept, the spoiled last one rejected
        steps.uniforms[0, GAMMA - 1: GAMMA + 1] = torch.tensor([0.9999, 0.5])
        table = TableDrafter(tiny_teacher, GAMMA, spoil=False, context=prompt)
        drafted = table.table[int(ref)].clone()
        drafted[-1] = (drafted[-1] + 1) % tiny_teacher.vocab_size  # the last node rejected: a partial path
        steps.tokens_RT[0, :GAMMA].copy_(drafted)
        steps.parents_RT[0, :GAMMA].copy_(torch.arange(-1, GAMMA - 1))
        if steps.probs_RTV is not None:
            steps.probs_RTV[0].zero_().scatter_(1, steps.tokens_RT[0, :GAMMA].clamp(min=0).view(-1, 1), 1.0)
        steps.cache.bucket = 256  # as the decoder sets it before a step
        with torch.no_grad():
            steps.verify(Bucket(GAMMA, chain, 256), sampling)
        count = 1 + int(steps.out[0, 0])  # the committed rows: the pending token's, then the accepted path's
        results.append((steps.out.clone(), int(steps.cache.length[0]), count, steps.committed_ids[0, :count].clone(),
                        steps.committed_hidden[-1][0, :count].clone(), int(steps.pending[0])))
    (out_c, len_c, n_c, ids_c, h_c, p_c), (out_t, len_t, n_t, ids_t, h_t, p_t) = results
    for a, b in zip(*seen):
        torch.testing.assert_close(a, b)
    assert n_c == n_t and 1 < n_c <= GAMMA and len_c == len_t and p_c == p_t
    assert torch.equal(out_c, out_t) and torch.equal(ids_c, ids_t)
    torch.testing.assert_close(h_c, h_t)
