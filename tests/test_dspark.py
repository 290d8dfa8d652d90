"""DSpark: the Markov head starts as DFlash and is teacher-forced as decoding applies it, the confidence loss, greedy
identity with the confidence cut (static step, eager proposal, batched rows), the static step drafting what
``propose`` drafts, the sampled output distribution at batch 1 and 4 with the cut on, save/load and config errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distill.losses import forward_kl
from heads.base import build_drafter
from heads.dspark.model import DSparkDrafter
from heads.saved import load_drafter
from inference.batch_decoder import BucketDecoder
from inference.decoder import Decoder
from inference.batch_steps import cut_width
from tests.drafters import (DFLASH_NODE, DSPARK_NODE, assert_batch_drafts_what_each_row_drafts_alone,
                            assert_sampling_keeps_the_target_distribution, dspark, save, varied_teacher)


def batch_of(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def teacher():
    return varied_teacher()


def test_markov_head_starts_as_dflash(teacher):
    """``markov_w2`` starts at zero: an untrained DSpark's token loss is DFlash's with the same backbone weights and
    the same anchor draws, and the Markov head still gets a gradient (through ``markov_w2``)."""
    torch.manual_seed(0)
    flash = build_drafter(DFLASH_NODE, teacher)
    flash.bind_target(teacher, initialize=True)
    spark = build_drafter({**DSPARK_NODE, "confidence_head": False}, teacher)
    spark.bind_target(teacher, initialize=True)
    missing, unexpected = spark.load_state_dict(flash.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("markov_head.") for k in missing)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    signals = teacher.signals(batch_of(ids), flash.teacher_layers)
    torch.manual_seed(7)
    want, n = flash(batch_of(ids), signals).loss(forward_kl)
    torch.manual_seed(7)
    got, m = spark(batch_of(ids), signals).loss(forward_kl)
    torch.testing.assert_close(got, want)
    assert int(n) == int(m)
    got.backward()
    assert spark.markov_head.markov_w2.weight.grad.abs().sum() > 0


def test_training_slots_are_the_decoding_slots_teacher_forced(teacher):
    """Slot k's training logits (Markov bias of the training token at a + k - 1) equal the decoding logits of the
    same block when slot k - 1 drafted that token: the Markov head is applied as it was trained."""
    drafter = dspark(teacher, objective="distill")
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = drafter(batch_of(ids), teacher.signals(batch_of(ids), drafter.teacher_layers))
    for a in (1, 9):
        drafter.reset()
        drafter.observe(teacher(ids[:, :a], None, drafter.teacher_layers).hidden)
        with torch.no_grad():
            states = drafter.block_states(ids[0, a], a)
            for k in range(1, drafter.block_size):
                if a + k < 20:  # term k - 1's rows are the anchors 1, 2, ... in order
                    want = drafter.slot_logits(states[k: k + 1], drafter.latent(ids[0, a + k - 1: a + k], states))
                    torch.testing.assert_close(out.terms[k - 1].student_NV[a - 1], want[0], atol=1e-5, rtol=1e-5)


def test_confidence_loss_is_the_bce_of_the_greedy_acceptance(teacher):
    """The auxiliary loss is Σ_k weight_k Σ_rows BCE(c, 1[argmax == the target's token]) x confidence_weight, and it
    trains the confidence head (a gradient reaches ``proj``)."""
    drafter = dspark(teacher, confidence_weight=0.5)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    signals = teacher.signals(batch_of(ids), drafter.teacher_layers)
    torch.manual_seed(3)
    out = drafter(batch_of(ids), signals)
    torch.manual_seed(3)
    states, pos, drawn = drafter.train_blocks(batch_of(ids), signals)
    prev = ids.gather(1, (pos - 1).clamp(0, 15).view(2, -1)).view(pos.shape)
    latent = drafter.markov_head.markov_w1(prev)
    want = 0.0
    for k, term in enumerate(out.terms, start=1):
        hit = (term.student_NV.argmax(-1) == term.label_N).float()
        c = drafter.confidence(states[:, :, k].reshape(-1, states.shape[-1]),
                               latent[:, :, k].reshape(-1, latent.shape[-1]))
        want = want + term.weight * (F.binary_cross_entropy_with_logits(c, hit, reduction="none") * term.weight_N).sum()
    torch.testing.assert_close(out.aux_loss_sum, 0.5 * want)
    out.aux_loss_sum.backward()
    assert drafter.confidence_head.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("threshold", [None, 0.4])
def test_greedy_is_identical_to_plain_static_eager_and_batched(teacher, threshold):
    """Plain greedy decoding's tokens, with the block fixed and cut: through the static step (the decoder), the
    eager proposal (a drafter without a static step) and the batched rows. The cut offers fewer positions."""
    drafter = dspark(teacher, confidence_threshold=threshold)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (m,), generator=g) for m in (5, 9, 12)]
    refs = [Decoder(teacher).plain(p[None], 20).new_tokens for p in prompts]
    decoder = Decoder(teacher)
    drafter.clear_offered()
    assert [decoder.speculative(drafter, p[None], 20, 5).new_tokens for p in prompts] == refs
    static_offered = drafter.offered_positions()
    eager = drafter.with_threshold(threshold)
    eager.static_draft = lambda *args, **kwargs: None
    assert [decoder.speculative(eager, p[None], 20, 5).new_tokens for p in prompts] == refs
    result = BucketDecoder(teacher).speculative(drafter, prompts, 20, 5)
    assert [gen.new_tokens for gen in result.generations] == refs
    if threshold is None:
        assert static_offered % 5 == 0
    else:
        assert 0 < static_offered < 5 * 60  # some slots cut, some offered


def test_a_cut_block_is_a_prefix_and_an_empty_cut_is_a_plain_step(teacher):
    """The running product of the confidences only falls, so the kept slots are a prefix, offered in the verify
    bucket of their length (1, 2, 4, then all 5) filled with the drafted tokens; a threshold above every first
    slot's confidence drafts nothing (the decode is then plain steps, still the target's tokens)."""
    drafter = dspark(teacher, confidence_threshold=0.0)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    drafter.reset()
    drafter.observe(teacher(prompt[:, :-1], None, drafter.teacher_layers).hidden)
    full = drafter.propose(prompt, 5)
    assert full.size == 5
    with torch.no_grad():
        states = drafter.block_states(prompt[0, -1], prompt.shape[1] - 1)[1:6]
        prev = torch.cat([prompt[0, -1:], full.tokens[:-1]])
        product = torch.sigmoid(drafter.confidence(states, drafter.latent(prev, states))).cumprod(0)
    for t in (product * (1 - 1e-4)).tolist():  # just below each product: the cut keeps that slot
        cut = drafter.with_threshold(t)
        cut.observe(teacher(prompt[:, :-1], None, drafter.teacher_layers).hidden)
        tree = cut.propose(prompt, 5)
        assert tree.tokens.tolist() == full.tokens[: cut_width(int((product >= t).sum()), 5)].tolist()
    never = drafter.with_threshold(0.999999)
    never.static_draft = lambda *args, **kwargs: None
    gen = Decoder(teacher).speculative(never, prompt, 12, 5)
    assert gen.new_tokens == Decoder(teacher).plain(prompt, 12).new_tokens
    assert never.offered == 0


@pytest.mark.parametrize("threshold", [None, 0.4])
def test_a_cut_chain_is_verified_at_its_own_width(teacher, threshold):
    """With the cut, each verification feeds the pending token plus the chain bucket of the offered length (1, 2, 4,
    then the full depth), not the full block, through the static step and the eager proposal alike; both paths
    draft the same chains (an empty cut still hands the drafter its committed rows). Without it, every verification
    is full width."""
    drafter = dspark(teacher, confidence_threshold=threshold)
    eager = drafter.with_threshold(threshold)
    eager.static_draft = lambda *args, **kwargs: None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (m,), generator=g) for m in (6, 11)]
    seen = []
    for d in (drafter, eager):
        decoder = Decoder(teacher)
        gens = [decoder.speculative(d, p[None], 24, 5) for p in prompts]
        forwards = {size: sum(g.nodes_per_forward[size] for g in gens) for size in range(6)}
        width = sum(g.verified_positions for g in gens)
        full = 1 + 5  # the pending token and the whole chain (near the end too, where fewer tokens are drafted)
        assert width == sum(n * (1 + cut_width(size, 5) if threshold else full) for size, n in forwards.items())
        seen.append(forwards)
    assert seen[0] == seen[1]
    if threshold is not None:
        assert sum(n for k, n in seen[0].items() if k < 4) > 0  # some chains cut below the widest bucket


@pytest.mark.parametrize("threshold,vocab", [(None, None), (0.4, 24)])
def test_a_batch_drafts_what_each_row_drafts_alone(teacher, threshold, vocab):
    drafter = dspark(teacher, confidence_threshold=threshold, draft_vocab_size=vocab).eval()
    assert_batch_drafts_what_each_row_drafts_alone(teacher, drafter, 5)


@pytest.mark.parametrize("threshold,vocab", [(None, None), (0.4, None), (0.4, 24)])
def test_static_draft_drafts_what_propose_drafts(teacher, threshold, vocab):
    """Through the step decoder's stand-in: every greedy static draft's offered slots (the verify bucket of its
    cut) equal the eager ``propose`` on the same context; a sampled static draft draws every slot in the support of
    its distribution."""
    from inference.sampling import GREEDY, SamplingConfig
    from tests.static_harness import Replay, committed_for, counts

    drafter = dspark(teacher, confidence_threshold=threshold, draft_vocab_size=vocab)
    if vocab:
        drafter.d2t.copy_(torch.randperm(128, generator=torch.Generator().manual_seed(5))[:vocab].sort().values)
    M = 4
    for sampling in (GREEDY, SamplingConfig(temperature=0.8, top_k=20)):
        committed = committed_for(drafter, M)
        static = drafter.static_draft(committed, 64, sampling, torch.Generator().manual_seed(0))
        replay = Replay(teacher, tuple(drafter.teacher_layers), 11, new_tokens=M * 8 + 2, seed=11)
        replay.prefill(static)
        drafter.reset()
        drafter.observe({i: h[None] for i, h in replay.hidden_at(0, 11).items()})
        for step, count in enumerate(counts(8, M, seed=11)):
            if step:
                start = replay.position
                replay.commit(committed, count)
                drafter.observe({i: h[None] for i, h in replay.hidden_at(start, start + count).items()})
            static.draft()
            tokens = static.buffers.tokens_T.tolist()
            offered = M - 1 if threshold is None else cut_width(int(static.kept), M - 1)
            if sampling.greedy:
                eager = drafter.propose(replay.context(), M - 1, GREEDY).tokens.tolist()
                assert tokens[:offered] == eager, (step, count)
                continue
            probs = static.buffers.probs_TV
            assert min(tokens) >= 0
            assert bool((probs[torch.arange(M - 1), torch.tensor(tokens, dtype=torch.long)] > 0).all())


@pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_sampled_output_distribution_is_the_targets_with_the_cut(batch):
    """Temperature-1 sampling through the decode loop (batch 1: the static step; batch 4: the batched rows) with the
    Markov head and the confidence cut on draws each 3-token continuation with the target's own probability."""
    assert_sampling_keeps_the_target_distribution({**DSPARK_NODE, "block_size": 3, "markov_rank": 4,
                                                   "confidence_threshold": 0.2}, batch)


def test_save_load_round_trip_and_threshold_override(teacher, tmp_path):
    drafter = dspark(teacher, confidence_threshold=0.3)
    path = save(drafter, tmp_path, "dspark", teacher)
    loaded = load_drafter(path, teacher)
    assert isinstance(loaded, DSparkDrafter) and loaded.confidence_threshold == 0.3
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, atol=0, rtol=0)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    assert Decoder(teacher).speculative(loaded, prompt, 12, 5).new_tokens == \
        Decoder(teacher).speculative(drafter, prompt, 12, 5).new_tokens
    assert "confidence_threshold" in DSparkDrafter.decode_keys


@pytest.mark.parametrize("key,value,match", [
    ("markov_rank", -1, "markov_rank"),
    ("confidence_threshold", 1.5, "confidence_threshold"),
    ("confidence_weight", -1.0, "confidence_weight"),
])
def test_bad_config_names_the_key(teacher, key, value, match):
    with pytest.raises(ValueError, match=match):
        build_drafter({**DSPARK_NODE, key: value}, teacher)


def test_confidence_with_markov_needs_a_markov_head(teacher):
    with pytest.raises(ValueError, match="confidence_with_markov"):
        build_drafter({**DSPARK_NODE, "markov_rank": 0}, teacher)
    drafter = build_drafter({**DSPARK_NODE, "markov_rank": 0, "confidence_with_markov": False}, teacher)
    assert drafter.markov_head is None and drafter.confidence_head.proj.in_features == teacher.hidden_size
