"""Compiling the decoder's steps at batch 1, its one-row bucket (``decoder.compile``), the fast checks (dynamo only:
backend "eager"):

- ``compiled_steps`` (also used by the slow inductor test, tests/test_decoder_compile.py) counts the step functions a
  decoder ran compiled and names those that fell back; a step with a graph break is caught;
- a decoder making more step functions than dynamo's per-code-object recompile limit (lowered to 3) still compiles
  every one (each compiled step gets its own code object);
- DFlash's static draft step compiles to one graph, no break, no recompile over two prompts and varying accepted
  lengths, and drafts what ``propose`` drafts; sampled, DFlash's and P-EAGLE's are one graph too (EAGLE's greedy
  static steps: tests/test_static_draft.py; P-EAGLE's: tests/test_peagle.py);
- the step kernel counter of ``scripts/bench_step_kernels.py`` on a tiny plain step: inductor's kernels fewer than the
  eager ops, and more than none.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

from inference.batch_decoder import BucketDecoder
from inference.batch_steps import cut_width
from inference.runner import compiled_of
from inference.sampling import GREEDY, SamplingConfig
from tests.drafters import dflash, dspark, varied_teacher
from tests.static_harness import committed_for, layout, one_graph_over_plays, tensors_of
from tests.test_decoder_transfers import make


def step_kind(key: tuple) -> str:
    """A ``BucketDecoder._fns`` key -> "draft", "prefill", "plain" or "verify"."""
    if key[1] in ("draft", "prefill"):
        return key[1]
    return "plain" if key[1].nodes == 0 else "verify"


def compiled_steps(decoder) -> tuple[collections.Counter, list[str]]:
    """(step functions that ran compiled, by ``step_kind``; the steps that did not, with the reason): a step counts as
    compiled once it ran at least once through its compiled function (``_Compiled`` keeps the compiled function
    unless compiling failed, then it holds the eager step)."""
    steps = getattr(decoder, "batch", decoder)  # a ``Decoder``'s steps are its ``BucketDecoder``'s
    done, failed = collections.Counter(), []
    for key, fn in steps._fns.items():
        fn = compiled_of(fn)  # under a CUDA graph: the compiled step
        if fn is None:
            failed.append(f"{step_kind(key)}: not compiled")
        elif fn.compiled is fn.fn:
            failed.append(f"{step_kind(key)}: fell back ({steps.fallback_reason})")
        elif fn.calls:
            done[step_kind(key)] += 1
    return done, failed


def eager_compiled(teacher) -> BucketDecoder:
    return BucketDecoder(teacher, generator=torch.Generator().manual_seed(0), cuda_graphs="off", compile=True,
                         compile_backend="eager")


def decode_plain(dec: BucketDecoder, prompt_ids: torch.Tensor, n: int) -> list[int]:
    """Plain decoding of one prompt ([1, P]) through the decoder's one-row bucket: its new tokens."""
    return dec.plain([prompt_ids[0]], n).generations[0].new_tokens


def decode_speculative(dec: BucketDecoder, drafter, prompt_ids: torch.Tensor, n: int, num_draft: int) -> list[int]:
    """Speculative decoding of one prompt ([1, P]) through the decoder's one-row bucket: its new tokens."""
    return dec.speculative(drafter, [prompt_ids[0]], n, num_draft).generations[0].new_tokens


@pytest.fixture(scope="module")
def teacher():
    return varied_teacher()


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_step_with_a_graph_break_is_caught(teacher, monkeypatch):
    """The check the inductor test relies on: a static draft step that breaks the graph falls back, and
    ``compiled_steps`` names it (the verify and prefill steps still count as compiled)."""
    torch._dynamo.reset()
    drafter = make("medusa_chain", teacher)
    build = drafter.static_draft

    def broken(*args, **kwargs):
        static = build(*args, **kwargs)
        if not getattr(static, "broken", False):
            draft = static.draft

            def with_break():
                torch._dynamo.graph_break()
                draft()

            static.draft, static.broken = with_break, True
        return static

    monkeypatch.setattr(drafter, "static_draft", broken)
    dec = eager_compiled(teacher)
    ref = decode_plain(dec, prompt(9), 12)
    assert decode_speculative(dec, drafter, prompt(9), 12, 3) == ref  # decoded uncompiled, still identical
    done, failed = compiled_steps(dec)
    assert failed == [f"draft: fell back ({dec.fallback_reason})"] and "graph_break" in dec.fallback_reason.lower()
    assert done["verify"] == 1 and done["plain"] == 1 and not done["draft"]


# The limit lowered to 3: the same failure as at the default 8, with a third of the step functions to compile.
@torch._dynamo.config.patch(recompile_limit=3)
def test_more_steps_than_the_recompile_limit_all_compile(teacher):
    """Every step function (plain, verify buckets, prefill buckets, each drafter's draft step) used to share one code
    object with dynamo, whose recompile limit (8 per code object by default) then made the ninth step run
    uncompiled."""
    torch._dynamo.reset()
    dec = eager_compiled(teacher)
    want = decode_plain(dec, prompt(9, 9), 16)
    for kind in ("medusa_chain", "medusa_tree", "draft_model"):
        assert decode_speculative(dec, make(kind, teacher), prompt(9, 9), 16, 3) == want, kind
    done, failed = compiled_steps(dec)
    assert not failed and dec.fallback_reason is None
    assert torch._dynamo.config.recompile_limit == 3 and sum(done.values()) > 3, done
    assert done["draft"] == 3 and done["verify"] >= 2 and done["prefill"] >= 2, done


@pytest.mark.parametrize("window,vocab", [(None, None), (8, 24)], ids=["full", "window-vocab"])
def test_dflash_static_draft_is_one_graph_in_place(teacher, window, vocab):
    drafter = dflash(teacher, sliding_window=window, draft_vocab_size=vocab)
    if vocab:
        drafter.d2t.copy_(torch.randperm(128, generator=torch.Generator().manual_seed(5))[:vocab].sort().values)
    committed = committed_for(drafter, 4)
    static = drafter.static_draft(committed, 64, GREEDY, None)
    before = layout(tensors_of(static))

    def check(i, context):
        assert static.buffers.tokens_T.tolist() == drafter.propose(context, 3, GREEDY).tokens.tolist(), i

    one_graph_over_plays(teacher, drafter, static, committed, (5, 11), 10, check)
    assert layout(tensors_of(static)) == before


def test_dspark_static_draft_with_the_cut_is_one_graph_in_place(teacher):
    """DSpark's slot-by-slot Markov chain and confidence cut inside the static step: one graph, no recompile, the
    buffers in place, and the eager proposal's chain (the cut's verify bucket) as the static draft's first slots,
    the cut's count in ``kept``."""
    drafter = dspark(teacher, confidence_threshold=0.15, draft_vocab_size=24)
    drafter.d2t.copy_(torch.randperm(128, generator=torch.Generator().manual_seed(5))[:24].sort().values)
    committed = committed_for(drafter, 4)
    static = drafter.static_draft(committed, 64, GREEDY, None)
    before = layout(tensors_of(static))

    offered = []

    def check(i, context):
        eager = drafter.propose(context, 3, GREEDY).tokens.tolist()
        assert cut_width(int(static.kept), 3) == len(eager), i
        assert static.buffers.tokens_T.tolist()[: len(eager)] == eager, i
        offered.append(len(eager))

    one_graph_over_plays(teacher, drafter, static, committed, (5, 11), 10, check)
    assert {0, 1, 3} <= set(offered)  # cut to nothing, to one slot, and not cut
    assert layout(tensors_of(static)) == before


@pytest.mark.parametrize("kind", ["dflash", "peagle", "dspark"])
def test_sampled_static_draft_is_one_graph(teacher, kind):
    if kind == "dflash":
        drafter = dflash(teacher)
    elif kind == "dspark":
        drafter = dspark(teacher)
    else:
        from tests.test_peagle import _static_drafter

        drafter = _static_drafter(teacher)
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    committed = committed_for(drafter, 4)
    static = drafter.static_draft(committed, 64, sampling, torch.Generator().manual_seed(0))
    drafted = []

    def check(i, context):
        drafted.append(tuple(static.buffers.tokens_T.tolist()))
        assert bool((static.buffers.probs_TV.gather(1, static.buffers.tokens_T[:, None]) > 0).all())

    one_graph_over_plays(teacher, drafter, static, committed, (5, 11), 10, check)
    assert len(set(drafted)) > len(drafted) // 2  # draws, not one fixed chain


# Slow: a check of the kernel-count bench's counter, not of a decode path.
@pytest.mark.slow
def test_step_kernel_counter_sees_fusion():
    """``scripts/bench_step_kernels.py``'s counts on a tiny plain step: inductor fuses the eager ops into fewer
    kernels, and emits some."""
    from scripts.bench_step_kernels import count_step, tiny_target

    target = tiny_target()
    counts = count_step(target, "plain")
    assert counts["compiled"]["kernels"] > 0 and counts["compiled"]["extern"] > 0
    assert counts["eager"]["kernel_ops"] > counts["compiled"]["total"] > 0, counts


def test_one_compilation_per_step_kind_across_capacity_buckets():
    """A decode that moves from the 256-column bucket to the 512-column one (the cache's whole capacity) runs two
    plain step functions, one per bucket, but compiles the plain step once: the key columns are a dynamic size, and
    no guard on them (the last bucket's view of the keys was once contiguous where the others were not) recompiles
    it. Token-identical to the eager steps; a second such decode compiles nothing."""
    from distill.teacher import Teacher
    from inference.decoder import Decoder
    from tests.conftest import make_tiny_llama
    from torch._dynamo.utils import counters

    long_teacher = Teacher(make_tiny_llama(initializer_range=0.2, max_position_embeddings=1024), tokenizer=None,
                           name="tiny-llama-1024")
    torch._dynamo.reset()
    counters.clear()
    # aot_eager: AOTAutograd's checks (contiguity among them) run, as under inductor
    dec = BucketDecoder(long_teacher, generator=torch.Generator().manual_seed(0), cuda_graphs="off", compile=True,
                        compile_backend="aot_eager")
    want = Decoder(long_teacher).plain(prompt(250), 20).new_tokens
    assert decode_plain(dec, prompt(250), 20) == want
    (steps,) = dec._states.values()
    plain = [key[1].columns for key in dec._fns if key[1] != "prefill"]
    assert steps.cache.capacity == 512 and sorted(plain) == [256, 512], plain
    assert counters["stats"]["unique_graphs"] == 2 and dec.describe()["compiled_steps"] == 2  # prefill, plain
    with torch.compiler.set_stance("fail_on_recompile"):
        assert decode_plain(dec, prompt(250), 20) == want


def test_inductor_cache_lives_under_the_project_cache_unless_set(monkeypatch, tmp_path):
    from inference.runner import inductor_cache_dir, use_inductor_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    assert inductor_cache_dir() == str(tmp_path / "cache" / "inductor")
    use_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    use_inductor_cache()  # a directory the user chose is kept
    assert inductor_cache_dir() == str(tmp_path / "mine") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
