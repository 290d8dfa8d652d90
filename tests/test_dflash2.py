"""DFlash2: the convolutions and the selector start as DFlash, the convolutions never cross a block boundary, the
selector's loss is the K-way cross-entropy it is documented as, greedy identity through the static step, the eager
proposal and the batched rows, the static step drafting what ``propose`` drafts, the sampled output distribution at
batch 1 and 4, save / load, the FLOP count, and the refusals (a reduced vocabulary, bad sizes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distill.losses import forward_kl
from heads.base import build_drafter
from heads.dflash2.conv import BlockConv
from heads.dflash2.model import DFlash2Drafter
from heads.saved import load_drafter
from inference.batch_decoder import BucketDecoder
from inference.decoder import Decoder
from tests.drafters import (DFLASH2_NODE, DFLASH_NODE, assert_batch_drafts_what_each_row_drafts_alone,
                            assert_sampling_keeps_the_target_distribution, dflash2, save, varied_teacher)


def batch_of(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def teacher():
    return varied_teacher()


def test_an_untrained_dflash2_is_dflash_and_both_new_parts_get_gradients(teacher):
    """Base kernels [1, 0] and zero kernel projections make every layer DFlash's; the selector's zero hidden
    projection makes its walk DFlash's top-1. So with DFlash's backbone weights, the token loss equals DFlash's and
    the proposal is DFlash's; the convolutions get a gradient from the token loss, the selector from its own."""
    torch.manual_seed(0)
    flash = build_drafter(DFLASH_NODE, teacher)
    flash.bind_target(teacher, initialize=True)
    flash2 = build_drafter(DFLASH2_NODE, teacher)
    flash2.bind_target(teacher, initialize=True)
    missing, unexpected = flash2.load_state_dict(flash.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    signals = teacher.signals(batch_of(ids), flash.teacher_layers)
    torch.manual_seed(7)
    want, n = flash(batch_of(ids), signals).loss(forward_kl)
    torch.manual_seed(7)
    out = flash2(batch_of(ids), signals)
    torch.manual_seed(7)
    alone = build_drafter({**DFLASH2_NODE, "selector": False}, teacher)
    alone.bind_target(teacher, initialize=True)
    alone.load_state_dict(flash2.state_dict(), strict=False)
    token_loss, m = alone(batch_of(ids), signals).loss(forward_kl)
    torch.testing.assert_close(token_loss, want)
    assert int(n) == int(m)
    got, _ = out.loss(forward_kl)
    assert float(out.aux_loss_sum) > 0
    got.backward()
    assert flash2.layers[0].attention_conv.kernel_projection.weight.grad.abs().sum() > 0
    assert flash2.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0
    flash.eval(), flash2.eval()
    for drafter in (flash, flash2):
        drafter.reset()
        drafter.observe(teacher(ids[:, :9], None, drafter.teacher_layers).hidden)
    assert flash2.propose(ids[:, :10], 5).tokens.tolist() == flash.propose(ids[:, :10], 5).tokens.tolist()


def test_the_convolution_reads_the_slot_before_within_its_block_only():
    """Slot t reads slots t and t - 1 of its own block: a change at the last slot of block 0 moves nothing of block 1,
    and a change at slot 2 moves slots 2 and 3 only."""
    torch.manual_seed(0)
    conv = BlockConv(8, block_size=4, kernel_size=2, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 8, 8)  # 2 blocks of 4 slots
    y = conv(x, conv.kernels(x), 0)
    for t, moved in ((3, {3}), (2, {2, 3})):
        x2 = x.clone()
        x2[0, t] += 1.0
        y2 = conv(x2, conv.kernels(x2), 0)
        changed = {i for i in range(8) if not torch.allclose(y[0, i], y2[0, i])}
        assert changed == moved, (t, changed)


def test_selector_loss_is_the_k_way_cross_entropy_towards_the_targets_token(teacher):
    """The auxiliary loss is Σ_k weight_k Σ_rows CE(scores over the unary top-K with the target's token put in where
    the list misses it, given the target's token at the slot before), x selector_weight; the warm-up ramps it in."""
    drafter = dflash2(teacher, selector_weight=0.5, selector_top_k=4, selector_warmup_steps=4)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    signals = teacher.signals(batch_of(ids), drafter.teacher_layers)
    drafter.begin_step(1)  # the second step of 4: half the weight
    torch.manual_seed(3)
    out = drafter(batch_of(ids), signals)
    torch.manual_seed(3)
    states, pos, drawn = drafter.train_blocks(batch_of(ids), signals)
    B, N, S = pos.shape
    gold_BT = signals.argmax_BT()
    prev = ids.gather(1, pos[..., 0]).reshape(-1)
    want = 0.0
    sel = drafter.candidate_selector
    for k in range(1, S):
        rows = (drawn & (pos[..., k] < 16)).reshape(-1).float()
        gold = gold_BT[torch.arange(B)[:, None].expand(B, N).reshape(-1), (pos[..., k].clamp(max=16) - 1).reshape(-1)]
        state = states[:, :, k].reshape(B * N, -1)
        logits = teacher.output_logits(state)
        unary, cand = logits.topk(4, -1)
        for r in range(B * N):  # by hand: the gold token replaces the last candidate where it is missing
            if gold[r] not in cand[r]:
                cand[r, -1], unary[r, -1] = gold[r], logits[r, gold[r]]
        label = torch.tensor([cand[r].tolist().index(int(gold[r])) for r in range(B * N)])
        scores = unary + ((sel.predecessor_codebook(prev) * sel.hidden_projection(state))[:, None]
                          * sel.successor_codebook(cand)).sum(-1)
        want = want + drafter.slot_weight(k) * (F.cross_entropy(scores, label, reduction="none") * rows).sum()
        prev = gold
    torch.testing.assert_close(out.aux_loss_sum, 0.5 * 0.5 * want, atol=1e-4, rtol=1e-4)
    drafter.begin_step(10)
    assert float(drafter._selector_ramp) == 1.0


@pytest.mark.parametrize("node", [{}, {"conv": False}, {"selector": False}], ids=["both", "selector", "conv"])
def test_greedy_is_identical_to_plain_static_eager_and_batched(teacher, node):
    drafter = dflash2(teacher, **node)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (m,), generator=g) for m in (5, 9, 12)]
    refs = [Decoder(teacher).plain(p[None], 20).new_tokens for p in prompts]
    decoder = Decoder(teacher)
    assert [decoder.speculative(drafter, p[None], 20, 5).new_tokens for p in prompts] == refs
    eager = dflash2(teacher, **node)
    eager.static_draft = lambda *args, **kwargs: None
    assert [decoder.speculative(eager, p[None], 20, 5).new_tokens for p in prompts] == refs
    result = BucketDecoder(teacher).speculative(drafter, prompts, 20, 5)
    assert [gen.new_tokens for gen in result.generations] == refs


def test_a_batch_drafts_what_each_row_drafts_alone(teacher):
    assert_batch_drafts_what_each_row_drafts_alone(teacher, dflash2(teacher).eval(), 5)


def test_static_draft_drafts_what_propose_drafts(teacher):
    """Every greedy static draft equals the eager ``propose`` on the same context; a sampled one draws each slot
    inside its candidates, where its distribution (zero outside them) is positive."""
    from inference.sampling import GREEDY, SamplingConfig
    from tests.static_harness import Replay, committed_for, counts

    drafter = dflash2(teacher)
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
            if sampling.greedy:
                assert tokens == drafter.propose(replay.context(), M - 1, GREEDY).tokens.tolist(), (step, count)
                continue
            probs = static.buffers.probs_TV
            assert bool((probs[torch.arange(M - 1), torch.tensor(tokens)] > 0).all())
            assert bool(((probs > 0).sum(-1) <= drafter.selector_top_k).all())
            torch.testing.assert_close(probs.sum(-1), torch.ones(M - 1))


@pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_sampled_output_distribution_is_the_targets(batch):
    """Temperature-1 sampling through the decode loop (batch 1: the static step; batch 4: the batched rows), the
    walk drawing among 3 of the 4 ids, draws each 3-token continuation with the target's own probability."""
    assert_sampling_keeps_the_target_distribution({**DFLASH2_NODE, "block_size": 3, "conv_group_size": 4,
                                                   "selector_top_k": 3, "selector_rank": 4}, batch)


def test_save_load_round_trip(teacher, tmp_path):
    drafter = dflash2(teacher)
    path = save(drafter, tmp_path, "dflash2", teacher)
    loaded = load_drafter(path, teacher)
    assert isinstance(loaded, DFlash2Drafter)
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, atol=0, rtol=0)
    assert any(k.endswith("attention_conv.base_kernel") for k in loaded.state_dict())
    assert "candidate_selector.predecessor_codebook.weight" in loaded.state_dict()
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    assert Decoder(teacher).speculative(loaded, prompt, 12, 5).new_tokens == \
        Decoder(teacher).speculative(drafter, prompt, 12, 5).new_tokens


def test_the_flop_count_adds_the_convolutions_and_the_selector_to_dflashs(teacher):
    from distill.flops import TargetShape

    shape = TargetShape.of(teacher)
    full = dflash2(teacher).train_flops(shape, 2, 64).drafter.linear
    neither = dflash2(teacher, conv=False, selector=False).train_flops(shape, 2, 64).drafter.linear
    conv_only = dflash2(teacher, selector=False).train_flops(shape, 2, 64).drafter.linear
    assert neither < conv_only < full
    flash = build_drafter(DFLASH_NODE, teacher)
    assert neither == pytest.approx(flash.train_flops(shape, 2, 64).drafter.linear)


@pytest.mark.parametrize("key,value,match", [
    ("draft_vocab_size", 64, r"draft_vocab_size=64: DFlash2's selector .* whole vocabulary"),
    ("selector_top_k", 0, "selector_top_k"),
    ("selector_rank", 0, "selector_rank"),
    ("selector_weight", -1.0, "selector_weight"),
    ("conv_group_size", 7, "conv_group_size=7 must divide"),
    ("conv_kernel_size", 9, "conv_kernel_size"),
])
def test_bad_config_names_the_key(teacher, key, value, match):
    with pytest.raises(ValueError, match=match):
        build_drafter({**DFLASH2_NODE, key: value}, teacher)
