"""The acceptance-aligned losses (``distill.losses.lk``, ``acceptance_weighted``) and DSpark's ``confidence_target: tv``.

The acceptance of a row is α = Σ_v min(p_v, q_v) = 1 − TV(p, q) (p the teacher, q the drafter). Checked: LK is 0 at
q = p and grows as q leaves p; the weights equal Σ min(p, q) by hand; masked sums match a per-row reference; the
chunked path (autograd per chunk: no hand-written gradient, no liger) equals the materialised loss for every drafter
kind; bad arguments are refused naming the key; a short training run works with each; DSpark's confidence head
trains towards 1 − TV. Tolerances as tests/test_losses_chunked.py (float32, only summation order differs).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn

from distill import fused_kernels, losses
from distill.cache import check_loss
from distill.chunked import TeacherRows, chunked_acceptance, chunked_divergence, slice_positions
from distill.teacher_output import TeacherOutput
from heads.base import build_drafter
from tests.drafters import DSPARK_NODE, NODES, dspark, varied_teacher
from tests.test_losses_chunked import ATOL, KINDS, RTOL, drafter_and_batch
from train.config import load_config, register_configs

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()

ACCEPTANCE = {
    "lk_alpha": functools.partial(losses.lk, temperature=1.0, variant="alpha"),
    "lk_lambda": functools.partial(losses.lk, temperature=1.5, variant="lambda", eta=3.0),
    "aw_fkl": functools.partial(losses.acceptance_weighted, temperature=1.0, base="fkl"),
    "aw_jsd": functools.partial(losses.acceptance_weighted, temperature=2.0, base="jsd", base_kwargs={"beta": 0.3}),
    "aw_lk": functools.partial(losses.acceptance_weighted, base="lk", base_kwargs={"variant": "lambda"}),
}


def alpha_by_hand(student_NV: torch.Tensor, teacher_NV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    q, p = F.softmax(student_NV.double() / temperature, -1), F.softmax(teacher_NV.double() / temperature, -1)
    return torch.minimum(p, q).sum(-1)


def test_lk_is_zero_at_the_teacher_and_falls_as_the_drafter_approaches_it():
    """q_λ = (1 − λ) p + λ q₀ has α = 1 − λ·TV(p, q₀) exactly: both LK variants fall strictly as λ goes to 0, where
    they are 0 (up to float rounding)."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(6, 40, generator=g) * 2
    far = torch.randn(6, 40, generator=g) * 2
    p, q0 = F.softmax(teacher.double(), -1), F.softmax(far.double(), -1)
    for variant in losses.LK_VARIANTS:
        values = []
        for lam in (1.0, 0.75, 0.5, 0.25, 0.1):
            student = ((1 - lam) * p + lam * q0).log().float()
            values.append(float(losses.lk(student, teacher, None, variant=variant)[0]))
        at_teacher = float(losses.lk(teacher, teacher, None, variant=variant)[0])
        assert all(a > b for a, b in zip(values, values[1:])), (variant, values)
        assert values[-1] > at_teacher and abs(at_teacher) < 1e-5, (variant, at_teacher)
    # LK^alpha is -log α, α known in closed form along the path
    lam = 0.5
    student = ((1 - lam) * p + lam * q0).log().float()
    tv0 = 0.5 * (p - q0).abs().sum(-1)
    torch.testing.assert_close(losses.lk(student, teacher, None)[0].double(), -(1 - lam * tv0).log().sum(),
                               rtol=1e-5, atol=1e-5)


def test_lk_lambda_blends_forward_kl_and_tv_by_the_detached_acceptance():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(5, 30, generator=g), torch.randn(5, 30, generator=g)
    a = alpha_by_hand(s, t).float()
    kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    tv = 1 - a
    w = torch.exp(-2.0 * a)
    torch.testing.assert_close(losses.lk(s, t, None, variant="lambda", eta=2.0)[0], (w * kl + (1 - w) * tv).sum(),
                               rtol=1e-5, atol=1e-5)
    # eta 0: forward KL exactly
    torch.testing.assert_close(losses.lk(s, t, None, variant="lambda", eta=0.0)[0], losses.forward_kl(s, t, None)[0])


@pytest.mark.parametrize("name", list(ACCEPTANCE))
def test_gradients_are_finite_even_where_the_overlap_underflows(name):
    """Logits 60 apart: α underflows float32 (e^-60 per token), yet −log α comes from a log-sum-exp of the log-probs'
    minimum, so loss and gradient stay finite."""
    V = 16
    teacher = torch.full((3, V), -30.0)
    teacher[:, 0] = 30.0
    student = torch.full((3, V), -30.0)
    student[:, 1] = 30.0
    student = torch.cat([student, torch.randn(2, V)]).requires_grad_()
    teacher = torch.cat([teacher, torch.randn(2, V)])
    loss, n = ACCEPTANCE[name](student, teacher, None)
    (grad,) = torch.autograd.grad(loss, [student])
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and int(n) == 5
    assert grad.abs().sum() > 0


def test_acceptance_weights_are_the_overlap_computed_by_hand():
    """p = (.5, .3, .2), q = (.2, .2, .6): Σ min = .6, TV = .4; p = (.7, .2, .1), q = (.6, .3, .1): Σ min = .9,
    TV = .1. TV weighted by the acceptance: .6 x .4 + .9 x .1 = .33."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.7, 0.2, 0.1]])
    q = torch.tensor([[0.2, 0.2, 0.6], [0.6, 0.3, 0.1]])
    log_p, log_q = p.log(), q.log()
    torch.testing.assert_close(losses.log_acceptance(log_q, log_p).exp(), torch.tensor([0.6, 0.9]))
    torch.testing.assert_close(losses.acceptance_weighted(log_q, log_p, None, base="tvd")[0], torch.tensor(0.33))
    kl = (p * (log_p - log_q)).sum(-1)
    torch.testing.assert_close(losses.acceptance_weighted(log_q, log_p, None)[0], (torch.tensor([0.6, 0.9]) * kl).sum())
    # the weight is detached: the gradient is a x (the base's gradient), a held constant
    s = log_q.clone().requires_grad_()
    (got,) = torch.autograd.grad(losses.acceptance_weighted(s, log_p, None)[0], [s])
    s2 = log_q.clone().requires_grad_()
    per_row = F.kl_div(F.log_softmax(s2, -1), log_p, log_target=True, reduction="none").sum(-1)
    (want,) = torch.autograd.grad((torch.tensor([0.6, 0.9]) * per_row).sum(), [s2])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", list(ACCEPTANCE))
def test_masked_mean_matches_a_per_row_reference(name):
    """loss_sum / num_valid over a [B, T, V] batch with a mask equals the mean of the loss of each masked row alone."""
    loss_fn = ACCEPTANCE[name]
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(2, 7, 20, generator=g) * 2, torch.randn(2, 7, 20, generator=g) * 2
    mask = torch.rand(2, 7, generator=g) > 0.4
    loss, n = loss_fn(s, t, mask)
    rows = [float(loss_fn(s[b, i][None], t[b, i][None], None)[0]) for b, i in mask.nonzero().tolist()]
    assert int(n) == len(rows) == int(mask.sum())
    assert math.isclose(float(loss) / int(n), sum(rows) / len(rows), rel_tol=1e-5)


@pytest.mark.parametrize("name", list(ACCEPTANCE))
def test_chunked_weighted_rows_equal_the_materialised_loss_through_autograd(name):
    """No hand-written gradient (``fused_divergence`` is None) and no liger (``liger_beta`` names why): the chunked
    path differentiates each chunk by autograd and equals the materialised loss and gradients, weighted rows too."""
    loss_fn = ACCEPTANCE[name]
    assert losses.fused_divergence(loss_fn) is None and losses.row_divergence(loss_fn) is not None
    assert "is not one liger computes" in fused_kernels.liger_beta(loss_fn)
    g = torch.Generator().manual_seed(3)
    B, T, D, V = 2, 9, 8, 30
    head = nn.Linear(D, V, bias=False)
    teacher = TeacherOutput(logits_BTV=torch.randn(B, T, V, generator=g) * 3)
    x = torch.randn(B * T, D, generator=g, requires_grad=True)
    weight_N = (torch.rand(B * T, generator=g) > 0.3).float()
    rows = TeacherRows(teacher, *slice_positions(B, T))
    got, _ = chunked_divergence(x, head, rows, loss_fn, chunk_elements=4 * V, weight_N=weight_N)
    got_grads = torch.autograd.grad(got, [x, head.weight])
    mask = weight_N > 0
    want = loss_fn(head(x), teacher.logits_BTV.reshape(B * T, V), mask)[0]
    want_grads = torch.autograd.grad(want, [x, head.weight])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # the acceptance alone, chunked and without a graph, over the same rows (rows of weight 0 answer 0)
    alpha = chunked_acceptance(x, head, rows, weight_N, chunk_elements=4 * V)
    torch.testing.assert_close(alpha, torch.where(mask, alpha_by_hand(head(x), teacher.logits_BTV.reshape(B * T, V)),
                                                  0).float())


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("loss", ["lk_lambda", "aw_fkl"])
def test_every_drafter_kind_trains_with_the_acceptance_losses(tiny_teacher, kind, loss):
    """Each drafter kind's loss, computed in chunks inside its call, equals the configured loss on its materialised
    terms (the lazy forward), with gradients to match."""
    loss_fn = ACCEPTANCE[loss]
    drafter, batch = drafter_and_batch(KINDS[kind], tiny_teacher)
    if hasattr(drafter, "prepare") and kind.startswith("eagle3"):
        drafter.prepare(type("D", (), {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"],
                                       "attention_mask": batch["attention_mask"]})())
    params = [p for p in drafter.parameters() if p.requires_grad]
    lazy = drafter(batch, tiny_teacher.signals(batch, drafter.teacher_layers))
    ref = lazy.aux_loss_sum if lazy.aux_loss_sum is not None else 0
    for term in lazy.terms:
        ref = ref + term.weight * loss_fn(term.student_NV, term.teacher_NV, term.mask_N)[0]
    ref_grads = torch.autograd.grad(ref, params)
    signals = tiny_teacher.signals(batch, drafter.teacher_layers, dense=drafter.dense_teacher_logits)
    got, _ = drafter(batch, signals, loss_fn=loss_fn).loss(loss_fn)
    grads = torch.autograd.grad(got, params)
    assert torch.isfinite(got) and got > 0
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "peagle"])
def test_block_and_parallel_drafters_train_with_the_acceptance_losses(teacher, kind):
    """DFlash and DSpark slots (objective distill) and PEAGLE's parallel depths: the chunked loss inside the call
    equals LK on the materialised terms (anchors drawn under the same seed), with finite gradients."""
    loss_fn = ACCEPTANCE["lk_alpha"]
    node = {**NODES[kind], **({"objective": "distill"} if kind != "peagle" else {"layers": [0, 1, 2]})}
    torch.manual_seed(0)
    drafter = build_drafter(node, teacher)
    drafter.bind_target(teacher, initialize=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    batch = batch_of(ids)
    params = [p for p in drafter.parameters() if p.requires_grad]
    torch.manual_seed(5)
    lazy = drafter(batch, teacher.signals(batch, drafter.teacher_layers))
    ref = lazy.aux_loss_sum if lazy.aux_loss_sum is not None else 0
    for term in lazy.terms:
        ref = ref + term.weight * loss_fn(term.student_NV, term.teacher_NV, term.mask_N)[0]
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    torch.manual_seed(5)
    signals = teacher.signals(batch, drafter.teacher_layers, dense=drafter.dense_teacher_logits)
    got, _ = drafter(batch, signals, loss_fn=loss_fn).loss(loss_fn)
    grads = torch.autograd.grad(got, params, allow_unused=True)
    assert torch.isfinite(got) and got > 0
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        if a is not None:
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def compose_loss(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return load_config(compose(config_name="config", overrides=list(overrides)))


def test_presets_compose_and_instantiate_to_the_menu_functions():
    from hydra.utils import instantiate

    lk = instantiate(compose_loss("loss=lk").loss)
    assert lk.func is losses.lk and lk.keywords == {"temperature": 1.0, "variant": "alpha", "eta": 3.0}
    cfg = compose_loss("loss=acceptance_weighted", "loss.base=jsd", "loss.base_kwargs={beta: 0.3}")
    aw = instantiate(cfg.loss)
    assert aw.func is losses.acceptance_weighted and dict(aw.keywords["base_kwargs"]) == {"beta": 0.3}
    assert losses.row_divergence(aw) is not None  # resolved and checked, DictConfig or dict alike


@pytest.mark.parametrize("overrides, message", [
    (["loss=lk", "loss.variant=beta"], r"loss.variant='beta' is not an LK loss; valid: \['alpha', 'lambda'\]"),
    (["loss=lk", "loss.eta=-1"], r"loss.eta=-1.* must be a finite number >= 0"),
    (["loss=lk", "loss.temperature=0"], r"loss.temperature=0.* must be > 0"),
    (["loss=acceptance_weighted", "loss.base=kl"], r"loss.base='kl' is not a divergence .* valid: \['fkl', 'rkl'"),
    (["loss=acceptance_weighted", "loss.base=jsd", "loss.base_kwargs={k: 3}"],
     r"loss.base_kwargs has \['k'\], which loss.base=jsd does not take; valid: \['beta'\]"),
    (["loss=acceptance_weighted", "loss.base=jsd", "loss.base_kwargs={beta: 2}"],
     r"must lie in \[0, 1\].*set in loss.base_kwargs, for loss.base=jsd"),
    (["loss=acceptance_weighted", "loss.base_kwargs=3"], r"loss.base_kwargs=3 must be a mapping"),
])
def test_bad_arguments_are_refused_at_start_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose_loss(*overrides)
    compose_loss(overrides[0])  # the preset itself is fine


def test_the_offline_cache_refuses_a_weighted_reverse_kl_and_a_base_k_past_its_top_k():
    with pytest.raises(ValueError, match="loss=rkl weighs the teacher's whole tail"):
        check_loss({"_target_": "distill.losses.acceptance_weighted", "base": "rkl"}, topk=16)
    with pytest.raises(ValueError, match=r"loss.k=32 exceeds the teacher cache's top-16"):
        check_loss({"_target_": "distill.losses.acceptance_weighted", "base": "topk_fkl",
                    "base_kwargs": {"k": 32}}, topk=16)
    check_loss({"_target_": "distill.losses.acceptance_weighted", "base": "fkl"}, topk=16)
    check_loss({"_target_": "distill.losses.lk"}, topk=16)


@pytest.fixture(scope="module")
def cache(tiny_toy_target):
    import os

    return Path(os.environ["SPECDRAFT_CACHE"])


@pytest.mark.parametrize("loss", [("loss=lk",), ("loss=lk", "loss.variant=lambda"), ("loss=acceptance_weighted",)])
def test_a_short_eagle3_run_trains_with_the_loss(cache, tmp_path, loss):
    """`python -m train loss=lk` (in-process, the tiny toy target, EAGLE-3, 4 steps): finite losses logged and the
    configured loss recorded with the saved drafter."""
    from tests.test_reliability_run import compose_cfg
    from train.run import run_training

    cfg = compose_cfg(cache, *loss, drafter=("drafter=eagle3", "drafter.ttt_steps=2"))
    run_training(cfg, tmp_path)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    values = [r["train/loss"] for r in logged if "train/loss" in r]
    assert len(values) == 4 and all(math.isfinite(v) and v > 0 for v in values)
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert saved["training"]["loss"]["_target_"] == cfg.loss["_target_"]


# --- DSpark: the confidence head towards 1 - TV ------------------------------------------------------------------------

def batch_of(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def teacher():
    return varied_teacher()


def test_dspark_tv_confidence_is_the_bce_towards_the_overlap(teacher):
    """confidence_target=tv: the auxiliary loss is Σ_k weight_k Σ_rows BCE(c, Σ_v min(p_v, q_v)) x confidence_weight,
    q the slot's draft distribution (Markov bias included), p the target's over the same token; it differs from the
    greedy target's loss, and it trains the head."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    drafter = dspark(teacher, confidence_weight=0.5, confidence_target="tv")
    signals = teacher.signals(batch_of(ids), drafter.teacher_layers)
    torch.manual_seed(3)
    out = drafter(batch_of(ids), signals)
    torch.manual_seed(3)
    states, pos, drawn = drafter.train_blocks(batch_of(ids), signals)
    prev = ids.gather(1, (pos - 1).clamp(0, 15).view(2, -1)).view(pos.shape)
    latent = drafter.markov_head.markov_w1(prev)
    B, N = pos.shape[:2]
    b_N = torch.arange(B)[:, None].expand(B, N).reshape(-1)
    want = 0.0
    for k, term in enumerate(out.terms, start=1):
        t_N = pos[..., k].clamp(max=16).reshape(-1) - 1
        alpha = alpha_by_hand(term.student_NV, signals.logits_BTV[b_N, t_N]).float() * term.weight_N
        assert ((alpha > 0) & (alpha < 1))[term.weight_N > 0].all()  # a soft label, not a 0/1 hit
        c = drafter.confidence(states[:, :, k].reshape(-1, states.shape[-1]),
                               latent[:, :, k].reshape(-1, latent.shape[-1]))
        want = want + term.weight * (F.binary_cross_entropy_with_logits(c, alpha, reduction="none")
                                     * term.weight_N).sum()
    torch.testing.assert_close(out.aux_loss_sum, 0.5 * want, rtol=1e-5, atol=1e-5)
    greedy = dspark(teacher, confidence_weight=0.5)
    torch.manual_seed(3)
    assert not torch.allclose(greedy(batch_of(ids), signals).aux_loss_sum, out.aux_loss_sum)
    # a few steps on the confidence head alone lower its loss towards the soft labels
    opt = torch.optim.Adam(drafter.confidence_head.parameters(), lr=0.05)
    first = None
    for _ in range(8):
        torch.manual_seed(3)
        aux = drafter(batch_of(ids), signals, loss_fn=losses.forward_kl).aux_loss_sum
        assert torch.isfinite(aux)
        first = float(aux.detach()) if first is None else first
        opt.zero_grad()
        aux.backward()
        assert all(torch.isfinite(p.grad).all() for p in drafter.confidence_head.parameters())
        opt.step()
    assert float(aux.detach()) < first


def test_a_short_dspark_run_trains_its_confidence_head_towards_tv(cache, tmp_path):
    """`python -m train drafter=dspark drafter.confidence_target=tv loss=lk` in-process (tiny toy target, 4 steps):
    finite losses, and the saved drafter records the target."""
    from tests.test_reliability_run import compose_cfg
    from train.run import run_training

    cfg = compose_cfg(cache, "loss=lk", drafter=("drafter=dspark", "drafter.confidence_target=tv",
                                                 "drafter.block_size=4", "drafter.num_anchors=8",
                                                 "drafter.markov_rank=8", "drafter.objective=distill"))
    run_training(cfg, tmp_path)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    values = [r["train/loss"] for r in logged if "train/loss" in r]
    assert len(values) == 4 and all(math.isfinite(v) and v > 0 for v in values)
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert saved["drafter"]["confidence_target"] == "tv"


def test_dspark_tv_confidence_saves_and_a_bad_value_names_the_key(teacher):
    drafter = dspark(teacher, confidence_target="tv")
    assert drafter.saved_config(DSPARK_NODE)["confidence_target"] == "tv"
    with pytest.raises(ValueError, match=r"drafter.confidence_target='sampled' is not known; valid: \['greedy', 'tv'\]"):
        build_drafter({**DSPARK_NODE, "confidence_target": "sampled"}, teacher)
