"""EAGLE-1 / EAGLE-3 drafters: training-time test matches decoding, vocab maps, layer choice, frozen target,
save/load, greedy identity, bad input."""

from __future__ import annotations

import pytest
import torch

from distill.losses import forward_kl
from distill.teacher import Teacher
from heads.base import TargetDims
from heads.saved import load_drafter, save_drafter
import heads.eagle.model  # its _ttt_attention reads these names: the tests patch them there
from heads.eagle.attention import explicit_ttt_attention, ttt_mask
from heads.eagle.model import EagleDrafter
from heads.eagle.variants import default_feature_layers
from heads.layers import vocab_maps
from heads.train_attention import ttt_step_mask
from tests.eager_reference import BatchNodes, score_level
from inference.decoder import Decoder
from tests.conftest import make_tiny_llama
from inference.stats import simulated_tau
from tests.drafters import assert_batch_drafts_what_each_row_drafts_alone

DIMS = TargetDims(hidden_size=32, vocab_size=128, num_layers=2)
VARIANTS = [("eagle1", {}), ("eagle3", {"draft_vocab_size": 96})]


class Rows:
    """The three [N, T] tensors a drafter's ``prepare`` reads off a training dataset."""

    def __init__(self, ids):
        self.input_ids, self.attention_mask, self.loss_mask = ids, torch.ones_like(ids), torch.ones_like(ids)


def batch_of(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


def make(teacher, variant, seed=0, **kw):
    torch.manual_seed(seed)
    drafter = EagleDrafter(DIMS, variant=variant, **kw)
    drafter.bind_target(teacher, initialize=True)
    drafter.prepare(Rows(torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(seed))))
    with torch.no_grad():  # random, non-trivial weights (fresh RMSNorm / zero-ish init would hide bugs)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


@pytest.mark.parametrize("variant,kw", VARIANTS)
def test_training_time_test_equals_decoding(tiny_teacher, variant, kw):
    """TTT step j at position t must compute exactly what a depth-(j+1) draft node computes when decoding after
    t + 2 tokens: this pins the TTT attention mask (step-0 keys <= t plus earlier steps' keys at t only)."""
    drafter = make(tiny_teacher, variant, ttt_steps=3, **kw)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = drafter(batch_of(ids), tiny_teacher.signals(batch_of(ids), drafter.teacher_layers))
    assert len(out.terms) == 3
    for t in (0, 5, 12):
        drafter.reset()
        drafter.observe(tiny_teacher(ids[:, : t + 1], None, drafter.teacher_layers).hidden)
        with torch.no_grad():
            root = drafter._advance(ids[0, : t + 2])
            torch.testing.assert_close(drafter._logits(root[None])[0], out.terms[0].student_NV[t], atol=1e-5, rtol=1e-5)
            nodes = BatchNodes(root[None])
            ctx_k, ctx_v = drafter._ctx_kv
            ctx = (ctx_k, ctx_v, torch.ones(1, ctx_k.shape[2], dtype=torch.bool), torch.tensor([t + 1]))
            for j in (1, 2):  # the real continuation as a chain of draft nodes (slot j - 1, under slot j - 2)
                tok = int(drafter.t2d[ids[0, t + 1 + j]]) if variant == "eagle3" else int(ids[0, t + 1 + j])
                if tok < 0:
                    break  # the real token is outside the draft vocabulary: no node can carry it
                got = score_level(drafter, j, torch.tensor([[j - 2]]), torch.tensor([[tok]]), nodes, *ctx)[0, 0]
                got = got.float().log_softmax(-1)
                torch.testing.assert_close(got, out.terms[j].student_NV[t].log_softmax(-1), atol=1e-5, rtol=1e-5)


def test_ttt_attention_is_causal_and_shaped(tiny_teacher):
    """Changing tokens after position t + 1 + j leaves every step's output at positions <= t unchanged, and the
    steps' masks have the documented shapes: [T, T] causal for step 0, plus one column per earlier step."""
    drafter = make(tiny_teacher, "eagle3", ttt_steps=3, draft_vocab_size=96)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 12:] = (changed[0, 12:] + 7) % 128
    with torch.no_grad():
        a = drafter(batch_of(ids), tiny_teacher.signals(batch_of(ids), drafter.teacher_layers))
        b = drafter(batch_of(changed), tiny_teacher.signals(batch_of(changed), drafter.teacher_layers))
    for j in range(3):
        last = 12 - 2 - j  # position t reads token t + 1 + j <= 11 and features <= t
        torch.testing.assert_close(a.terms[j].student_NV[: last + 1], b.terms[j].student_NV[: last + 1])
        assert not torch.allclose(a.terms[j].student_NV[last + 2:], b.terms[j].student_NV[last + 2:])
        assert a.terms[j].student_NV.shape == (20 - 2 - j, 96)  # positions with a predicted token in the row
    q = torch.randn(1, 1, 5, 4)
    keys = [(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)) for _ in range(3)]
    out = drafter._ttt_attention(q, keys, ttt_step_mask(torch.ones(1, 5, dtype=torch.bool), 2))
    # Reference: step 2 at position t sees step-0 keys 0..t and steps 1, 2 at t only.
    for t in range(5):
        k = torch.cat([keys[0][0][0, 0, : t + 1], keys[1][0][0, 0, t: t + 1], keys[2][0][0, 0, t: t + 1]])
        v = torch.cat([keys[0][1][0, 0, : t + 1], keys[1][1][0, 0, t: t + 1], keys[2][1][0, 0, t: t + 1]])
        w = (q[0, 0, t] @ k.T / 2).softmax(-1)
        torch.testing.assert_close(out[0, 0, t], w @ v)



@pytest.mark.parametrize("steps", [1, 2, 4])
def test_explicit_ttt_attention_equals_the_fused_kernel(steps):
    """The CPU path (explicit scores, causal in place, hand-written backward) against SDPA under ``ttt_mask``: outputs
    at the real queries and the gradients of q and every step's k, v, with a right-padded row."""
    g = torch.Generator().manual_seed(steps)
    B, h, T, d = 2, 3, 9, 8
    attn = torch.ones(B, T, dtype=torch.bool)
    attn[1, 6:] = False
    mask = ttt_mask(attn, steps)
    leaf = lambda: torch.randn(B, h, T, d, generator=g, dtype=torch.float64).requires_grad_()
    q, keys = leaf(), [(leaf(), leaf()) for _ in range(steps)]
    inputs = [q, *(t for kv in keys for t in kv)]
    fused = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([k for k, _ in keys], 2), torch.cat([v for _, v in keys], 2), attn_mask=mask)
    explicit = explicit_ttt_attention(q, keys)
    assert explicit.dtype == q.dtype
    real = attn[:, None, :, None].expand_as(fused)  # padded queries see padding too: never read
    torch.testing.assert_close(explicit[real], fused[real], rtol=1e-5, atol=1e-6)  # float32 inside
    grad = torch.randn(fused.shape, generator=g, dtype=torch.float64) * real
    for want, got in zip(torch.autograd.grad(fused, inputs, grad), torch.autograd.grad(explicit, inputs, grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_training_step_is_the_same_through_either_attention(tiny_teacher, monkeypatch):
    """EAGLE-3 TTT 3 on a CPU takes the explicit path for steps 1 and 2; forcing the fused kernel everywhere gives
    the same loss and gradients."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    calls = []
    monkeypatch.setattr(heads.eagle.model, "explicit_ttt_attention",
                        lambda *a: calls.append(1) or explicit_ttt_attention(*a))

    def loss_and_grads():
        drafter = make(tiny_teacher, "eagle3", ttt_steps=3, draft_vocab_size=96).train()
        loss, _ = drafter(batch_of(ids), tiny_teacher.signals(batch_of(ids), drafter.teacher_layers)).loss(forward_kl)
        loss.backward()
        return [loss] + [p.grad for p in drafter.parameters()]

    explicit = loss_and_grads()
    assert len(calls) == 2  # steps 1 and 2; step 0 stays fused
    monkeypatch.setattr(heads.eagle.model, "EXPLICIT_ATTENTION_ELEMENTS", 0)
    fused = loss_and_grads()
    assert len(calls) == 2
    for got, want in zip(explicit, fused):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_ttt_warmup_trains_step_0_alone_first(tiny_teacher):
    drafter = make(tiny_teacher, "eagle3", ttt_steps=3, ttt_warmup_steps=2, draft_vocab_size=96)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(4))
    signals = tiny_teacher.signals(batch_of(ids), drafter.teacher_layers)
    terms = {}
    with torch.no_grad():
        for step in (0, 1, 2, 5):
            drafter.begin_step(step)
            terms[step] = drafter(batch_of(ids), signals).terms
    assert [len(terms[s]) for s in (0, 1, 2, 5)] == [1, 1, 3, 3]
    torch.testing.assert_close(terms[0][0].student_NV, terms[2][0].student_NV)  # step 0 is the same either way
    with pytest.raises(ValueError, match=r"drafter.ttt_warmup_steps must be >= 0"):
        EagleDrafter(DIMS, variant="eagle3", ttt_warmup_steps=-1)

def test_vocab_maps_round_trip():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 7])
    d2t, t2d = vocab_maps(counts, 4)
    assert d2t.tolist() == [0, 2, 3, 7]  # the 4 most frequent ids, in id order
    assert t2d[d2t].tolist() == [0, 1, 2, 3]  # d2t then t2d is the identity on the draft vocabulary
    outside = [j for j in range(8) if j not in d2t.tolist()]
    assert (t2d[outside] == -1).all()
    full_d2t, full_t2d = vocab_maps(counts, 8)
    assert full_d2t.tolist() == list(range(8)) and full_t2d.tolist() == list(range(8))


def test_prepare_builds_the_draft_vocab_from_data(tiny_teacher):
    drafter = EagleDrafter(DIMS, variant="eagle3", draft_vocab_size=8)
    drafter.bind_target(tiny_teacher, initialize=True)
    ids = torch.tensor([[3, 3, 3, 9, 9, 1, 50, 50, 50, 50, 2, 4, 5, 6, 7, 8]])
    drafter.prepare(Rows(ids))
    assert set(drafter.d2t.tolist()) == {1, 2, 3, 4, 5, 6, 9, 50}  # 50, 3, 9 first; ties broken by lower id
    # The draft lm_head starts from the target's rows of those tokens.
    torch.testing.assert_close(drafter.lm_head.weight, tiny_teacher.lm_head.weight[drafter.d2t])


def test_layer_selection_and_index_convention(tiny_teacher):
    assert default_feature_layers("eagle3", 32) == (2, 16, 29)  # the reference / vLLM / SGLang default
    assert default_feature_layers("eagle3", 28) == (2, 14, 25)
    assert default_feature_layers("eagle3", 4) == (1, 2, 4)  # shallow (toy) targets: low, middle, final
    assert default_feature_layers("eagle1", 32) == (-1,)
    drafter = EagleDrafter(DIMS, variant="eagle3", layers=[0, 1, 2])
    ids = torch.randint(0, 128, (1, 10))
    out = tiny_teacher(ids, None, drafter.teacher_layers)
    ref = tiny_teacher.model(ids, output_hidden_states=True).hidden_states
    for i in (0, 1, 2):  # index i is HF hidden_states[i]: 0 embeddings, 2 = the final normed output
        torch.testing.assert_close(out.hidden[i], ref[i])
    torch.testing.assert_close(tiny_teacher(ids, None, (-1,)).hidden[-1], ref[2])


@pytest.mark.parametrize("variant,kw", VARIANTS)
def test_gradients_reach_only_the_drafter(tiny_teacher, variant, kw):
    drafter = make(tiny_teacher, variant, **kw).train()
    ids = torch.randint(0, 128, (2, 16))
    out = drafter(batch_of(ids), tiny_teacher.signals(batch_of(ids), drafter.teacher_layers))
    loss, n = out.loss(forward_kl)
    assert n > 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in tiny_teacher.model.parameters())
    trained = [name for name, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert "fc.weight" in trained and "layer.q_proj.weight" in trained
    # The target's embedding / lm_head are used, never owned: not parameters, not saved.
    assert not any("embed" in k for k in drafter.state_dict())
    if variant == "eagle1":
        assert out.aux_loss_sum is not None and out.aux_loss_sum > 0  # the smooth-L1 feature loss
    else:
        assert out.aux_loss_sum is None and len(out.terms) == 7
        assert [round(t.weight, 4) for t in out.terms[:3]] == [1.0, 0.8, 0.64]


@pytest.mark.parametrize("variant,kw", VARIANTS)
def test_save_load_round_trip(tiny_teacher, tmp_path, variant, kw):
    drafter = make(tiny_teacher, variant, **kw)
    node = {"_target_": "heads.eagle.EagleDrafter", "variant": variant, **kw}
    save_drafter(drafter, tmp_path / "d", node, {}, tiny_teacher.identity())
    loaded = load_drafter(tmp_path / "d", tiny_teacher)
    assert loaded.teacher_layers == drafter.teacher_layers
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    dec = Decoder(tiny_teacher)
    a, b = dec.speculative(drafter, prompt, 20, 3), dec.speculative(loaded, prompt, 20, 3)
    assert a.new_tokens == b.new_tokens and a.stats.counts == b.stats.counts


@pytest.mark.parametrize("variant,kw", VARIANTS)
@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_greedy_identity(tiny_teacher, variant, kw, tree):
    drafter = make(tiny_teacher, variant, tree=tree, **kw)
    dec = Decoder(tiny_teacher)
    gen = torch.Generator().manual_seed(4)
    for n in (3, 9, 17):
        prompt = torch.randint(0, 128, (1, n), generator=gen)
        assert dec.speculative(drafter, prompt, 24, 4).new_tokens == dec.plain(prompt, 24).new_tokens


def test_trained_drafter_is_accepted(tiny_teacher):
    """End to end through the loss and the decoder: an EAGLE-1 fitted to the target's own greedy continuation of a
    prompt gets its drafts accepted when decoding that prompt (an untrained one gets τ ≈ 1)."""
    drafter = EagleDrafter(DIMS, variant="eagle1", feature_noise=0.0)
    drafter.bind_target(tiny_teacher, initialize=True)
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    dec = Decoder(tiny_teacher)
    ids = torch.cat([prompt, torch.tensor([dec.plain(prompt, 32).new_tokens])], 1)
    untrained = dec.speculative(drafter.eval(), prompt, 32, 4).stats.tau
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    signals = tiny_teacher.signals(batch_of(ids), drafter.teacher_layers)
    drafter.train()
    for _ in range(150):
        loss, n = drafter(batch_of(ids), signals).loss(forward_kl)
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    gen = dec.speculative(drafter.eval(), prompt, 32, 4)
    assert gen.new_tokens == ids[0, 8:].tolist()
    assert gen.stats.tau > max(2.0, untrained + 0.5)


def test_bad_input():
    with pytest.raises(ValueError, match=r"drafter.layers contains 5, out of range .* 2 layers"):
        EagleDrafter(DIMS, variant="eagle3", layers=[1, 2, 5])
    with pytest.raises(ValueError, match=r"drafter.layers=\[1\]: eagle3 reads 3"):
        EagleDrafter(DIMS, variant="eagle3", layers=[1])
    with pytest.raises(ValueError, match=r"draft_vocab_size=0 must be >= 1"):
        EagleDrafter(DIMS, variant="eagle3", draft_vocab_size=0)
    # A preset's draft vocabulary larger than a small target's: the full vocabulary (experiment=smoke drafter=eagle3)
    assert EagleDrafter(DIMS, variant="eagle3", draft_vocab_size=200).draft_vocab_size == 128
    with pytest.raises(ValueError, match=r"variant='eagle2'.*eagle1"):
        EagleDrafter(DIMS, variant="eagle2")
    with pytest.raises(ValueError, match=r"tree='default'.*dynamic"):
        EagleDrafter(DIMS, variant="eagle1", tree="default")
    drafter = EagleDrafter(DIMS, variant="eagle1")
    with pytest.raises(RuntimeError, match="observe"):
        drafter.propose(torch.tensor([[1, 2, 3]]), 3)


def test_deep_target_layers_are_checked_against_the_real_target():
    teacher = Teacher(make_tiny_llama(), tokenizer=None, name="tiny")
    drafter = EagleDrafter(TargetDims(32, 128, 2), variant="eagle3", layers=[0, 1, 2])
    drafter.bind_target(teacher, initialize=True)  # in range: fine
    assert drafter.teacher_layers == (0, 1, 2)


def test_simulated_tau():
    assert simulated_tau([]) == 1.0
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1.75)
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    # a draft LM's one next-token accuracy, applied at each of 4 depths: 1 + .5 + .25 + .125 + .0625
    assert simulated_tau([0.5], depth=4) == pytest.approx(1.9375)


def test_auto_tune_refuses_dynamic_trees_but_tunes_chains(tiny_teacher):
    from inference.cost import auto_tune

    drafter = make(tiny_teacher, "eagle1")
    dec = Decoder(tiny_teacher)
    prompts = [torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(6))]
    with pytest.raises(ValueError, match="dynamic tree.*decoder.tree=chain"):
        auto_tune(dec, drafter, prompts, 12, 3, repeats=2)
    drafter.set_tree("chain")
    assert auto_tune(dec, drafter, prompts, 12, 3, repeats=2)["chosen"]["num_draft"] in (1, 2, 3)


@pytest.mark.parametrize("variant,kw", VARIANTS)
@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_a_batch_drafts_what_each_row_drafts_alone(tiny_teacher, variant, kw, tree):
    assert_batch_drafts_what_each_row_drafts_alone(tiny_teacher, make(tiny_teacher, variant, tree=tree, **kw), 3)
