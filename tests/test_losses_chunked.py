"""The chunked projection + divergence (distill/chunked.py) equals the unchunked loss it replaces, for every divergence
of the menu, dense and sparse teachers, a reduced student vocabulary, and every drafter kind.

Reference: the public ``distill.losses`` functions on fully materialised logits — exactly how training computed the
loss before (``loss_fn(student_NV, teacher_NV, None)`` per term). Tolerance: loss and gradients agree to
rtol 1e-5 / atol 1e-6 (float32; only the summation order differs); for whole drafters, whose losses are sums of
many near-zero KL terms (a fresh drafter starts at the target), atol 1e-5 on the loss and 1e-4 relative on gradients.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distill import losses
from distill.chunked import Finished, TeacherRows, chunk_budget, chunked_cross_entropy, chunked_divergence, positions
from distill.teacher_output import TeacherOutput, dense_logits
from heads.base import build_drafter

RTOL, ATOL = 1e-5, 1e-6
MENU = {
    "fkl": functools.partial(losses.forward_kl, temperature=1.0),
    "fkl_T2": functools.partial(losses.forward_kl, temperature=2.0),
    "rkl": functools.partial(losses.reverse_kl, temperature=1.5),
    "jsd": functools.partial(losses.jsd, temperature=1.0, beta=0.3),
    "tvd": functools.partial(losses.total_variation, temperature=1.0),
    "topk_fkl": functools.partial(losses.topk_forward_kl, temperature=1.0, k=5),
    "not_in_menu": lambda s, t, m: losses.forward_kl(s * 1.1, t, m),  # called per chunk on logits
}


class CountingLinear(nn.Linear):
    """Records the rows of every call: the chunked loss must never project more than one chunk at a time."""

    def forward(self, x):
        self.calls.append(x.shape[0])
        return super().forward(x)


def setup(V=50, D=8, B=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = CountingLinear(D, V, bias=False)
    head.calls = []
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    teacher = TeacherOutput(logits_BTV=torch.randn(B, T, V, generator=g) * 3)
    mask = torch.rand(B, T, generator=g) > 0.3
    x = torch.randn(int(mask.sum()), D, generator=g, requires_grad=True)
    return head, teacher, mask, x


def reference(x, head, teacher_NV, loss_fn):
    """Today's computation: the whole [N, V] logits, then the loss."""
    loss = loss_fn(head(x), teacher_NV, None)[0]
    grads = torch.autograd.grad(loss, [x, head.weight])
    return loss, grads


def chunked(x, head, rows, loss_fn, chunk_elements):
    loss, pred = chunked_divergence(x, head, rows, loss_fn, chunk_elements=chunk_elements)
    grads = torch.autograd.grad(loss * 1.0, [x, head.weight])
    return loss, grads, pred


@pytest.mark.parametrize("name", list(MENU))
def test_chunked_equals_unchunked_loss_and_gradients(name):
    loss_fn = MENU[name]
    head, teacher, mask, x = setup()
    rows = TeacherRows(teacher, *positions(mask, 0))
    ref_loss, ref_grads = reference(x, head, teacher.logits_BTV[mask], loss_fn)
    head.calls = []
    loss, grads, pred = chunked(x, head, rows, loss_fn, chunk_elements=3 * 50)  # 3 rows per chunk
    assert max(head.calls) == 3 and len(head.calls) == -(-x.shape[0] // 3)  # never all rows at once
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert torch.equal(pred, head(x).argmax(-1))
    plain = nn.Linear(8, 50, bias=True)  # a plain Linear takes the hand-differentiated path (bias included)
    ref_loss = loss_fn(plain(x), teacher.logits_BTV[mask], None)[0]
    ref_grads = torch.autograd.grad(ref_loss, [x, plain.weight, plain.bias])
    loss, _ = chunked_divergence(x, plain, rows, loss_fn, chunk_elements=3 * 50)
    for got, want in zip(torch.autograd.grad(loss, [x, plain.weight, plain.bias]), ref_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("loss_fn", [MENU["fkl"], MENU["fkl_T2"], MENU["topk_fkl"],
                                     functools.partial(losses.topk_forward_kl, temperature=0.5, k=1)])
def test_hand_written_gradients_equal_autograd(loss_fn):
    """Forward KL and top-k forward KL skip autograd (``fused_divergence``: T·(q − p), p the teacher or its top k
    renormalised and scattered): each row's loss and the logit gradient equal autograd through the menu function,
    ties included."""
    fused, temperature = losses.fused_divergence(loss_fn)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 40, generator=g) * 2
    teacher = torch.randn(7, 40, generator=g) * 3
    teacher[0, :6] = teacher[0].max() + 1  # six tied top tokens in one row (k = 5 picks some of them)
    log_p = F.log_softmax(teacher / temperature, dim=-1)
    want_logits = logits.clone().requires_grad_()
    want = loss_fn(want_logits, teacher, None)[0]
    (want_grad,) = torch.autograd.grad(want, [want_logits])
    want_rows = torch.stack([loss_fn(logits[i: i + 1], teacher[i: i + 1], None)[0] for i in range(7)])
    for probs in (None, log_p.exp()):  # the teacher's probs computed inside, or handed over with its log-probs
        got, got_grad = fused(logits.clone(), log_p.clone(), None if probs is None else probs.clone())
        torch.testing.assert_close(got, want_rows, rtol=RTOL, atol=ATOL)  # one value per row
        torch.testing.assert_close(got.sum(), want.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got_grad, want_grad, rtol=RTOL, atol=ATOL)
    assert losses.fused_divergence(MENU["jsd"]) is None  # the others go through autograd on the chunk


def test_softmax_pair_is_log_softmax_and_softmax_from_one_exp():
    z = torch.randn(5, 300) * 8
    z[1, :7] = float("-inf")  # masked columns stay at probability 0
    want_log, want = F.log_softmax(z, dim=-1), F.softmax(z, dim=-1)
    log_q, q = losses.softmax_pair_(z.clone())
    torch.testing.assert_close(log_q, want_log, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["fkl", "jsd", "topk_fkl"])
def test_reduced_vocabulary_gathers_columns_like_the_full_row_copy(name):
    """EAGLE-3: the teacher restricted to the draft vocabulary ``cols``, as the old ``teacher_NV[:, d2t]``."""
    V, Vd = 50, 20
    head, teacher, mask, x = setup(V=V)
    head_d = nn.Linear(8, Vd, bias=False)
    cols = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:Vd].sort().values
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[cols] = torch.arange(Vd)
    rows = TeacherRows(teacher, *positions(mask, 0), cols=cols, label_map=t2d)
    full = teacher.logits_BTV[mask]
    ref_loss = MENU[name](head_d(x), full[:, cols], None)[0]
    ref_grads = torch.autograd.grad(ref_loss, [x, head_d.weight])
    loss, pred = chunked_divergence(x, head_d, rows, MENU[name], chunk_elements=4 * Vd)
    grads = torch.autograd.grad(loss, [x, head_d.weight])
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert torch.equal(rows.labels(), t2d[full.argmax(-1)])  # the target's top token, -1 when not drafted
    assert (rows.labels() == -1).any() and (rows.labels() >= 0).any()


@pytest.mark.parametrize("name", ["fkl", "jsd", "tvd", "topk_fkl"])
def test_sparse_teacher_equals_its_dense_expansion(name):
    """The offline cache's top-K stays sparse; each chunk expands its own rows exactly as the old dense tensor."""
    V, K = 50, 6
    head, dense, mask, x = setup(V=V)
    top = dense.logits_BTV.log_softmax(-1).topk(K, dim=-1)
    sparse = TeacherOutput(logits_BTV=None, topk_ids_BTK=top.indices, topk_logprobs_BTK=top.values, vocab_size=V,
                           dtype=torch.float32)
    old_dense = dense_logits(top.indices, top.values, V, torch.float32)  # what training used to build
    ref_loss, ref_grads = reference(x, head, old_dense[mask], MENU[name])
    loss, grads, _ = chunked(x, head, TeacherRows(sparse, *positions(mask, 0)), MENU[name], chunk_elements=2 * V)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert torch.equal(TeacherRows(sparse, *positions(mask, 0)).labels(), old_dense[mask].argmax(-1))


def test_teacher_log_normaliser_is_computed_once_per_batch(monkeypatch):
    """Three terms (heads / TTT steps) over one batch's teacher: its logsumexp pass runs for the first only."""
    head, teacher, mask, x = setup()
    calls = []
    original = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda *a, **k: calls.append(1) or original(*a, **k))
    T = mask.shape[1]
    for shift in (0, 1, 2):
        m = mask[:, : T - shift]
        chunked_divergence(x[: int(m.sum())], head, TeacherRows(teacher, *positions(m, shift)), MENU["fkl"])
    # The teacher's: one chunk per batch row (T * V fits a chunk), then shared (the fused forward KL normalises the
    # student by ``softmax_pair_``, not ``logsumexp``).
    assert len(calls) == teacher.logits_BTV.shape[0]


# --- every drafter kind: chunked in-forward loss == materialised logits + loss_fn ---------------------------------

KINDS = {
    "medusa": {"_target_": "heads.medusa.MedusaHeads", "num_heads": 3, "num_layers": 1},
    "eagle1": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "ttt_steps": 2,
               "feature_loss_weight": 1.0, "kl_weight": 0.1},
    "eagle3": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "ttt_steps": 3, "draft_vocab_size": 64},
    "eagle3_ckpt": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "ttt_steps": 3,
                    "draft_vocab_size": 64, "checkpoint_layer": True},
    "eagle1_one_step": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "ttt_steps": 1},
    "draft_model": {"_target_": "heads.draft_model.DraftModel"},
}
PROJECTED = {"eagle3", "eagle3_ckpt", "eagle1_one_step", "draft_model"}  # the teacher answers without [B, T, V] logits


def drafter_and_batch(node: dict, teacher) -> tuple:
    """A drafter built from ``node`` on ``teacher`` (seeded) and a 2 x 14 batch with a random loss mask."""
    torch.manual_seed(0)
    drafter = build_drafter(node, teacher)
    drafter.bind_target(teacher, initialize=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 14), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.rand(2, 14, generator=g) > 0.2}
    return drafter, batch


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("loss", ["fkl", "jsd"])
def test_every_drafter_kind_matches_the_materialised_loss(tiny_teacher, kind, loss):
    drafter, batch = drafter_and_batch(KINDS[kind], tiny_teacher)
    ids = batch["input_ids"]
    batch["attention_mask"][1, 11:] = 0  # a padded row
    if hasattr(drafter, "prepare") and kind.startswith("eagle3"):
        drafter.prepare(type("D", (), {"input_ids": ids, "loss_mask": batch["loss_mask"],
                                       "attention_mask": batch["attention_mask"]})())
    params = [p for p in drafter.parameters() if p.requires_grad]
    signals = tiny_teacher.signals(batch, drafter.teacher_layers)
    # Before: every term's logits materialised, then the configured loss on them.
    lazy = drafter(batch, signals)
    ref = lazy.aux_loss_sum if lazy.aux_loss_sum is not None else 0
    for term in lazy.terms:
        ref = ref + term.weight * MENU[loss](term.student_NV, term.teacher_NV, term.mask_N)[0]  # the trained rows
    ref_grads = torch.autograd.grad(ref, params)
    ref_agree = [(int((t.student_NV.argmax(-1) == t.label_N)[t.mask_N].sum()), int(t.mask_N.sum()))
                 for t in lazy.terms]
    # After: the loss computed in chunks inside the drafter's call, on the teacher's form the loop asks for.
    after = tiny_teacher.signals(batch, drafter.teacher_layers, dense=drafter.dense_teacher_logits)
    assert after.projected == (kind in PROJECTED) and (after.logits_BTV is None) == (kind in PROJECTED)
    out = drafter(batch, after, loss_fn=MENU[loss])
    got, n = out.loss(MENU[loss])
    grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert [(int(c), int(m)) for c, m in out.top1_agreement()] == ref_agree
    assert all(t.teacher is None for t in out.terms)  # the teacher's logits are released before backward


def test_projected_teacher_equals_the_dense_logits(tiny_teacher, monkeypatch):
    """The projected form (final hidden state + read-out) answers rows, a vocabulary slice, normalisers and argmax as
    the dense logits do, projecting at most ``PROJECT_CHUNK_ELEMENTS // V`` rows at a time and never [B, T, V]."""
    import distill.teacher_output as dt

    monkeypatch.setattr(dt, "PROJECT_CHUNK_ELEMENTS", 5 * 128)  # 5 rows per projection
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    dense = tiny_teacher(ids, mask, layers=(1,))
    proj = tiny_teacher(ids, mask, layers=(1,), dense=False)
    assert proj.projected and proj.logits_BTV is None and proj.final_BTD.shape == (2, 11, 32)
    torch.testing.assert_close(proj.hidden[1], dense.hidden[1])
    calls = []
    head = tiny_teacher.output_logits.lm_head
    handle = head.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    try:
        b_N, t_N = positions(torch.rand(2, 11, generator=torch.Generator().manual_seed(3)) > 0.3)
        torch.testing.assert_close(proj.rows(b_N, t_N), dense.rows(b_N, t_N), rtol=1e-5, atol=1e-5)
        assert torch.equal(proj.argmax_BT()[b_N, t_N], dense.argmax_BT()[b_N, t_N])
        n_rows = len(calls)
        assert torch.equal(proj.argmax_BT(), dense.argmax_BT())  # the rows not yet projected are projected now
        cols = torch.tensor([3, 7, 8, 50, 127])
        torch.testing.assert_close(proj.rows(b_N, t_N, cols), dense.rows(b_N, t_N, cols), rtol=1e-5, atol=1e-5)
        before = len(calls)
        for temperature in (1.0, 2.0):
            for c in (None, cols):
                torch.testing.assert_close(proj.log_normaliser(temperature, c), dense.log_normaliser(temperature, c),
                                           rtol=1e-5, atol=1e-5)
        proj.rows(b_N, t_N, cols)
        # The slice is kept (no projection for the last call); each full-V normaliser projects every row once, in
        # chunks of at most 5 rows of one batch row (11 = 5 + 5 + 1).
        assert calls[before:] == [5, 5, 1] * 2 * 2
    finally:
        handle.remove()
    assert calls[0] == len(b_N) and max(calls[1:n_rows]) <= 5  # the rows asked for; then the rest, in chunks
    assert proj.columns(cols).shape == (2, 11, 5)


def test_projected_teacher_falls_back_to_dense_when_the_readout_differs(tiny_teacher, caplog):
    """A target whose logits are not ``output_logits(hidden_states[-1])`` keeps answering densely (checked once)."""
    from distill.teacher import TargetLogits

    embed, logits = tiny_teacher.readout
    tiny_teacher.__dict__["readout"] = (embed, TargetLogits(logits.lm_head, softcap=0.5))  # a read-out that is wrong
    ids = torch.randint(0, 128, (1, 6))
    with caplog.at_level("WARNING"):
        out = tiny_teacher(ids, torch.ones_like(ids), dense=False)
    assert not out.projected and out.logits_BTV.shape == (1, 6, 128)
    assert "keeps dense" in caplog.text
    assert not tiny_teacher(ids, torch.ones_like(ids), dense=False).projected


def test_teacher_runs_under_inference_mode_and_hands_out_trainable_hidden_states(tiny_teacher):
    ids = torch.randint(0, 128, (1, 8))
    out = tiny_teacher(ids, torch.ones_like(ids), layers=(-1, 1))
    assert out.logits_BTV.is_inference()
    assert not any(h.is_inference() for h in out.hidden.values())  # drafters save them for backward
    lin = nn.Linear(32, 4)
    lin(out.hidden[-1][:, :4]).sum().backward()  # a view, saved by the layer: fine outside inference mode


def explicit_ttt_attention(q, keys, causal):
    """The implementation SDPA replaced: [B, h, T, T] scores plus one diagonal column per earlier step."""
    k0, v0 = keys[0]
    scale = q.shape[-1] ** -0.5
    scores = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True) * scale for k, _ in keys[1:]]
    weights = torch.cat([scores, *diag], -1).softmax(-1)
    T = k0.shape[2]
    out = weights[..., :T] @ v0
    for i, (_, v) in enumerate(keys[1:]):
        out = out + weights[..., T + i: T + i + 1] * v
    return out


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_through_sdpa_equals_explicit_scores(tiny_teacher, steps):
    from heads.train_attention import ttt_step_mask

    drafter = build_drafter(KINDS["eagle3"], tiny_teacher)
    g = torch.Generator().manual_seed(5)
    B, h, T, d = 2, 2, 9, 8
    attn = torch.ones(B, T, dtype=torch.bool)
    attn[1, :3] = False  # left padding
    q = torch.randn(B, h, T, d, generator=g)
    keys = [(torch.randn(B, h, T, d, generator=g), torch.randn(B, h, T, d, generator=g)) for _ in range(steps)]
    pos = torch.arange(T)
    causal = (pos[None, :] <= pos[:, None])[None, None] & attn[:, None, None, :]
    got = drafter._ttt_attention(q, keys, ttt_step_mask(attn, steps - 1, right_padded=False))
    want = explicit_ttt_attention(q, keys, causal)
    # Real queries agree; a padded query (never trained, never attended by a real one) now always sees its own
    # step-0 key, where the explicit scores left it none at step 0 (NaN).
    real = attn[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got).all()


def test_chunked_cross_entropy_equals_the_unchunked_loss_and_its_gradients():
    """Medusa-2's language-modelling term: hard labels through a soft-capped projection, in chunks of 5 rows."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 40)
    head = Finished(proj, lambda z: 30.0 * torch.tanh(z / 30.0))
    x = torch.randn(23, 8, requires_grad=True)
    labels = torch.randint(0, 40, (23,))
    chunked = chunked_cross_entropy(x, head, labels, vocab_size=40, chunk_elements=5 * 40)
    g_chunked = torch.autograd.grad(chunked, [x, proj.weight, proj.bias])
    full = F.cross_entropy(head(x).float(), labels, reduction="sum")
    g_full = torch.autograd.grad(full, [x, proj.weight, proj.bias])
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_chunked, g_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunk_budget_sets_the_rows_per_chunk_and_leaves_the_loss_unchanged():
    """``trainer.loss_chunk_elements`` (``chunk_budget``): rows per chunk = elements // V inside the block, the default
    outside it; loss and gradients equal whatever the chunking; a budget below 1 is refused naming the key."""
    head, teacher, mask, x = setup()
    rows = TeacherRows(teacher, *positions(mask))
    V = teacher.logits_BTV.shape[-1]
    with chunk_budget(3 * V):
        small, small_grads, _ = chunked(x, head, rows, MENU["jsd"], None)
    assert set(head.calls[:-1]) == {3} and len(head.calls) == -(-x.shape[0] // 3)
    head.calls.clear()
    whole, whole_grads, _ = chunked(x, head, rows, MENU["jsd"], None)
    assert head.calls == [x.shape[0]]  # the default budget (2^25) holds every row of this batch
    torch.testing.assert_close(small, whole, rtol=RTOL, atol=ATOL)
    for a, b in zip(small_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="trainer.loss_chunk_elements=0"):
        with chunk_budget(0):
            pass


def test_default_chunk_budget_follows_the_device():
    """``trainer.loss_chunk_elements: null`` (the default): 2^25 on a CPU, 2^28 on a GPU, whose memory has room for
    a 2k-token row's whole chunk; an explicit value is used as given (the loop passes it through)."""
    from distill.chunked import CHUNK_ELEMENTS, CUDA_CHUNK_ELEMENTS, default_chunk_elements

    assert default_chunk_elements("cpu") == CHUNK_ELEMENTS == 1 << 25
    assert default_chunk_elements(torch.device("cuda", 0)) == CUDA_CHUNK_ELEMENTS == 1 << 28
    assert default_chunk_elements("cuda") // 128_256 == 2092


@pytest.mark.parametrize("name", ["fkl", "topk_fkl", "jsd"])
def test_frozen_read_out_with_a_projected_teacher_over_uneven_chunks(name):
    """EAGLE-1's term: the student through the target's read-out (``Frozen``: never trained, even though its weight
    requires grad), the teacher projected chunk by chunk; on a CPU the forward-KL chunks reuse one set of [rows, V]
    buffers (``Workspace``), the last chunk shorter than the others."""
    from distill.chunked import Frozen
    from distill.teacher import TargetLogits

    g = torch.Generator().manual_seed(5)
    lm_head = nn.Linear(8, 50, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(50, 8, generator=g))
    read_out = TargetLogits(lm_head, softcap=None)
    final = torch.randn(1, 11, 8, generator=g)
    x = torch.randn(11, 8, generator=g, requires_grad=True)
    want = MENU[name](lm_head(x), lm_head(final[0]).detach(), None)[0]
    (want_grad,) = torch.autograd.grad(want, [x])
    signal = TeacherOutput(logits_BTV=None, final_BTD=final, readout=read_out, vocab_size=50)
    rows = TeacherRows(signal, torch.zeros(11, dtype=torch.long), torch.arange(11))
    loss, pred = chunked_divergence(x, Frozen(read_out), rows, MENU[name], chunk_elements=4 * 50)  # 4, 4, 3 rows
    (grad,) = torch.autograd.grad(loss, [x])
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, want_grad, rtol=RTOL, atol=ATOL)
    assert torch.equal(pred, lm_head(x).argmax(-1)) and lm_head.weight.grad is None


@pytest.mark.parametrize("frozen", [True, False])
def test_chunked_under_cpu_autocast_matches_the_autocast_projection(frozen):
    """Training runs under bf16 autocast where the device has it (``trainer.bf16``, CPUs included): the chunked
    projection casts the weight once (``autocast_weight``) instead of at every chunk, and must give the logits the
    autocast projection gives (the loss equal up to summation order) and its gradient (grad_x through the bf16
    weight, as autograd through the autocast projection computes it)."""
    from distill.chunked import Frozen
    from distill.teacher import TargetLogits

    g = torch.Generator().manual_seed(7)
    lm_head = nn.Linear(16, 64, bias=False).requires_grad_(not frozen)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(64, 16, generator=g))
    final = torch.randn(1, 13, 16, generator=g)
    x = torch.randn(13, 16, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = MENU["fkl"](lm_head(x), lm_head(final[0]).detach(), None)[0]
    want_grads = torch.autograd.grad(want, [x] + ([] if frozen else [lm_head.weight]))
    read_out = TargetLogits(lm_head, softcap=None)
    signal = TeacherOutput(logits_BTV=None, final_BTD=final, readout=read_out, vocab_size=64)
    rows = TeacherRows(signal, torch.zeros(13, dtype=torch.long), torch.arange(13))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, pred = chunked_divergence(x, Frozen(read_out) if frozen else lm_head, rows, MENU["fkl"],
                                        chunk_elements=5 * 64)
    grads = torch.autograd.grad(loss, [x] + ([] if frozen else [lm_head.weight]))
    torch.testing.assert_close(loss, want.float(), rtol=1e-5, atol=1e-4)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)  # bf16 matmuls, summed in other orders
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(pred, lm_head(x).argmax(-1))
