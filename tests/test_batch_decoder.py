"""The batched step decoder (inference.batch_decoder over inference.batch_steps and inference.batch_cache).

- batches of 1, 3 and 8 prompts of ragged lengths, rows finishing at different steps (ragged acceptance, EOS): each
  row token-identical to its batch-1 greedy decode, plain and for every drafter kind (through its static draft step
  and through its eager rows; tests/test_batch_static_draft.py tests the static step itself);
- the steps compile with ``torch.compile(fullgraph=True, dynamic=False)``: one graph per (batch bucket, step
  bucket) a decode uses, and no recompile over decodes of >= 64 steps (``set_stance("fail_on_recompile")``);
- finished rows move the batch to smaller buckets; one read-back per step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from heads.base import build_drafter
from inference.batch_decoder import BucketDecoder
from inference.generation import batch_bucket
from inference.decoder import Decoder
from inference.sampling import GREEDY, SamplingConfig
from inference.transfers import TransferCounter
from distill.teacher import Teacher
from tests.drafters import build, eager_proposals, tiny_llama

NEW = 20
KINDS = ["plain", "lookup", "medusa", "eagle1", "eagle3", "draft_model", "dflash", "peagle"]


@pytest.fixture(scope="module")
def teacher():
    """A 4-layer tiny Llama (EAGLE-3 and P-EAGLE read layers 1..3) whose greedy output varies."""
    return Teacher(tiny_llama(initializer_range=0.2, num_hidden_layers=4), tokenizer=None, name="tiny-llama-4")


def ragged_prompts(n: int = 8, seed: int = 1) -> list[torch.Tensor]:
    """Lengths 5..40; each repeats its first half so prompt lookup has matches (and misses)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, 128, (3 + (i * 13) % 25,), generator=g)
        out.append(torch.cat([p, p[: p.shape[0] // 2]]))
    return out


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts()


@pytest.fixture(scope="module")
def references(teacher, prompts):
    decoder = Decoder(teacher)
    return [decoder.plain(p[None], NEW).new_tokens for p in prompts]


def drafter_of(kind, teacher):
    if kind == "plain":
        return None
    if kind == "lookup":
        return build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
    return build(kind, teacher)


def decode(decoder, drafter, prompts, new=NEW, num_draft=3):
    if drafter is None:
        return decoder.plain(prompts, new)
    return decoder.speculative(drafter, prompts, new, num_draft)


@pytest.mark.parametrize("kind", KINDS)
def test_batches_of_1_3_and_8_are_token_identical_to_batch1(teacher, prompts, references, kind):
    """Through the drafter's static draft step at the bucket's rows and through per-row copies of its eager
    ``propose`` alike."""
    drafter = drafter_of(kind, teacher)
    accepted, buckets = set(), set()
    for static in (True, False) if kind not in ("plain", "lookup") else (True,):
        decoder = BucketDecoder(teacher, cuda_graphs="off", compile="off")
        for batch in (1, 3, 8):
            outputs = []
            for i in range(0, len(prompts), batch):
                with contextlib.nullcontext() if static or drafter is None else eager_proposals(drafter):
                    gen = decode(decoder, drafter, prompts[i: i + batch])
                outputs += [g.new_tokens for g in gen.generations]
                accepted.update(a for row in gen.stats.counts.values() for a in row)
                buckets.add(tuple(sorted(gen.bucket_steps)))
            for i, (ours, ref) in enumerate(zip(outputs, references)):
                assert ours == ref, (f"{kind}, batch {batch}, {'static' if static else 'per-row copies'}: prompt {i} "
                                     f"(length {len(prompts[i])}) differs from batch 1")
        assert any(key[1] == "draft" for key in decoder._fns) == (static and kind not in ("plain", "lookup"))
    if kind not in ("plain", "peagle"):  # ragged acceptance: rows finish at different steps and leave their bucket
        # (P-EAGLE off its init drafts nothing the target accepts: its rows run as plain decoding's do)
        assert len(accepted) >= 2, f"{kind}: accepted lengths did not vary: {accepted}"
        assert any(len(b) > 1 for b in buckets), f"{kind}: no batch moved to a smaller bucket: {buckets}"


def test_eos_finishes_rows_at_different_steps(teacher, prompts, references):
    # The token whose first occurrence falls at the most different places: rows then stop at different steps.
    firsts = {t: {r.index(t) for r in references if t in r[1:]} for r in references for t in r[1:]}
    eos = max(sorted(firsts), key=lambda t: len(firsts[t]))
    single = Decoder(teacher, eos_token_id=eos)
    refs = [single.plain(p[None], NEW).new_tokens for p in prompts]
    assert len({len(r) for r in refs}) > 1, "the test needs rows that stop at different lengths"
    decoder = BucketDecoder(teacher, eos_token_id=eos, cuda_graphs="off", compile="off")
    for gen in (decoder.plain(prompts, NEW), decoder.speculative(drafter_of("draft_model", teacher), prompts, NEW, 3)):
        assert [g.new_tokens for g in gen.generations] == refs
        assert len(gen.live_steps) > 1  # finished rows left the live batch


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


def graphs_over_long_decodes(teacher, kind, prompts):
    """Compile (dynamo, fullgraph): warm up on one decode of every batch, then decode again with recompiles
    refused; returns (graphs, step functions made, steps decoded, the outputs)."""
    torch._dynamo.reset()
    counters.clear()
    drafter = drafter_of(kind, teacher)
    decoder = BucketDecoder(teacher, cuda_graphs="off", compile="on", compile_backend="eager")
    batches = (prompts[:3],)  # buckets 4 -> 2 -> 1 as rows finish
    for batch in batches:
        decode(decoder, drafter, batch, 100)
    graphs = counters["stats"]["unique_graphs"]
    assert not counters["graph_break"], dict(counters["graph_break"])
    steps, outputs = 0, []
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch in batches:
            gen = decode(decoder, drafter, batch, 100)
            steps += gen.steps
            outputs += [g.new_tokens for g in gen.generations]
    assert counters["stats"]["unique_graphs"] == graphs
    return graphs, len(decoder._fns), steps, outputs


# medusa (slow): a tree's verify steps, which lookup's chains share but for the tree mask
@pytest.mark.parametrize("kind", ["plain", "lookup", pytest.param("medusa", marks=pytest.mark.slow)])
def test_one_graph_per_bucket_and_no_recompile_over_long_decodes(teacher, prompts, kind):
    graphs, made, steps, outputs = graphs_over_long_decodes(teacher, kind, prompts)
    assert graphs == made  # every (batch bucket, step bucket) compiled once, and nothing else
    assert steps >= 64
    single = Decoder(teacher)
    assert outputs == [single.plain(p[None], 100).new_tokens for p in prompts[:3]]


def test_one_read_back_per_step(teacher, prompts):
    decoder = BucketDecoder(teacher, cuda_graphs="off", compile="off")
    drafter = drafter_of("lookup", teacher)
    counts = []
    for new in (8, 40):
        with TransferCounter() as c:
            gen = decoder.speculative(drafter, prompts[:4], new, 3)
        counts.append((c.total, gen.steps))
    per_step = (counts[1][0] - counts[0][0]) / (counts[1][1] - counts[0][1])
    assert per_step <= 2, f"{per_step:.2f} host transfers per step"


def test_one_sampling_setting_per_batch(teacher, prompts):
    decoder = BucketDecoder(teacher, cuda_graphs="off", compile="off")
    hot = SamplingConfig(temperature=1.0, top_k=20)
    out = decoder.plain(prompts[:2], 5, sampling=[hot, hot])
    assert all(len(g.new_tokens) == 5 for g in out.generations)
    with pytest.raises(ValueError, match="a batch decodes with one SamplingConfig"):
        decoder.plain(prompts[:2], 5, sampling=[GREEDY, hot])
    with pytest.raises(ValueError, match="2 settings for 3 prompts"):
        decoder.plain(prompts[:3], 5, sampling=[hot, hot])


def test_max_batch_rows_decodes_larger_batches_in_groups_of_the_largest_bucket(teacher, prompts, references):
    """``decoder.max_batch_rows``: 8 prompts under a cap of 2 run as four groups, no bucket above 2, every row still its
    batch-1 greedy decode, the groups' figures merged (latencies from the start of the whole decode)."""
    drafter = drafter_of("lookup", teacher)
    decoder = BucketDecoder(teacher, cuda_graphs="off", compile="off", max_rows=2)
    gen = decode(decoder, drafter, prompts)
    assert [g.new_tokens for g in gen.generations] == references
    assert gen.bucket_steps and max(gen.bucket_steps) <= 2
    assert gen.steps == sum(gen.bucket_steps.values()) and gen.stats.forwards > 0
    assert max(g.seconds for g in gen.generations) <= gen.seconds + 1e-9
    assert gen.generations[-1].seconds > min(g.seconds for g in gen.generations[:2])
    for bad in (0, 3):
        with pytest.raises(ValueError, match=rf"decoder.max_batch_rows={bad}: .*power of two"):
            BucketDecoder(teacher, max_rows=bad)
