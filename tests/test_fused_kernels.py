"""``trainer.fused_kernel`` (distill/fused_kernels.py): liger-kernel's fused linear JSD behind
``distill.chunked.chunked_divergence`` equals the chunked PyTorch path where it is chosen, is chosen only where it is
exact, and ``liger`` forced where it cannot apply fails naming why.

The liger tests run liger-kernel's real Triton kernels on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1`` from process start: a subprocess, ``test_liger_under_the_triton_interpreter``); they skip,
with the reason, where liger-kernel is not installed (``pip install -e '.[gpu]'``). The one CUDA test (marked gpu)
has never run: no GPU in this project's CI.
Tolerance against the chunked path: rtol 1e-5 / atol 1e-6 on losses and gradients (float32; liger's mean x N
and its gradient scaling round differently from our sum); for whole drafters atol 1e-5 on the loss, as in
tests/test_losses_chunked.py.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from distill import fused_kernels, losses
from distill.chunked import (Finished, Frozen, TeacherRows, chunked_cross_entropy, chunked_divergence, positions,
                             slice_positions)
from distill.fused_kernels import fused_kernel
from distill.teacher import TargetLogits
from distill.teacher_output import TeacherOutput
from tests.test_losses_chunked import drafter_and_batch

RTOL, ATOL = 1e-5, 1e-6
LIGER = {  # the menu terms liger computes
    "fkl": functools.partial(losses.forward_kl, temperature=1.0),
    "fkl_T2": functools.partial(losses.forward_kl, temperature=2.0),
    "rkl_T1.5": functools.partial(losses.reverse_kl, temperature=1.5),
    "jsd_0.3": functools.partial(losses.jsd, temperature=1.0, beta=0.3),
    "jsd_T0.7": functools.partial(losses.jsd, temperature=0.7),  # the default beta, 0.5
}


def _installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def liger():
    """liger-kernel's kernels running under the Triton interpreter. ``triton.jit`` decides at definition time, and
    torch imports triton early (torch._native), so TRITON_INTERPRET=1 must be in the environment when the process
    starts: ``test_liger_under_the_triton_interpreter`` runs this file again in such a process."""
    if not _installed():
        pytest.skip("liger-kernel / triton not installed (pip install -e '.[gpu]'): the liger path is untested here")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 from process start: run by test_liger_under_the_triton_interpreter")
    import triton.language as tl

    if type(tl.max).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: its kernels would need a GPU")
    assert fused_kernels.liger_unavailable(torch.device("cpu")) is None


def test_liger_under_the_triton_interpreter():
    """This file's liger tests, in a process started with TRITON_INTERPRET=1 (real liger code, CPU tensors)."""
    if not _installed():
        pytest.skip("liger-kernel / triton not installed (pip install -e '.[gpu]'): the liger path is untested here")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already under the interpreter: the liger tests run in this process")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-m", "not gpu", "-k", "not test_liger_under_the_triton_interpreter"],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    tail = done.stdout[-4000:]
    assert done.returncode == 0, tail
    counts = re.search(r"(\d+) passed", tail)
    assert counts and int(counts[1]) >= 30 and "skipped" not in tail.splitlines()[-1], tail


@pytest.fixture
def liger_calls(monkeypatch):
    """How many terms went through liger (the real function is called)."""
    calls = []
    real = fused_kernels.liger_divergence
    monkeypatch.setattr(fused_kernels, "liger_divergence", lambda term: calls.append(term) or real(term))
    return calls


def projected(V=300, D=32, B=2, T=12, seed=0):
    """A projected teacher (final hidden state + read-out) and masked rows of it; the student's own head."""
    g = torch.Generator().manual_seed(seed)
    lm_head = nn.Linear(D, V, bias=False).requires_grad_(False)
    head = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(V, D, generator=g) / 2)
        head.weight.copy_(torch.randn(V, D, generator=g) / 2)
    signal = TeacherOutput(logits_BTV=None, final_BTD=torch.randn(B, T, D, generator=g),
                           readout=TargetLogits(lm_head, softcap=None), vocab_size=V)
    mask = torch.rand(B, T, generator=g) > 0.3
    x = torch.randn(int(mask.sum()), D, generator=g, requires_grad=True)
    return x, head, signal, mask


def run(choice, x, head, rows, loss_fn, **kw):
    """(loss, pred, grads w.r.t. x and the head's trainable weight) under ``trainer.fused_kernel=choice``; the
    backward with an upstream gradient other than 1 (liger scales its stored gradients then)."""
    with fused_kernel(choice):
        loss, pred = chunked_divergence(x, head, rows, loss_fn, **kw)
    wrt = [x] + [p for p in getattr(head, "parameters", list)() if p.requires_grad]
    return loss.detach(), pred, torch.autograd.grad(loss * 0.75, wrt)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained_head", "frozen_read_out"])
@pytest.mark.parametrize("name", list(LIGER))
def test_liger_equals_the_chunked_path(liger, liger_calls, name, frozen):
    """Loss, argmax and gradients (student rows; the head's weight where it trains) of masked rows, trained head or
    the target's frozen read-out (EAGLE-1's), at temperature 1 and not: liger's equal the chunked path's."""
    x, head, signal, mask = projected()
    if frozen:
        head = Frozen(signal.readout)
    rows = TeacherRows(signal, *positions(mask, 0))
    got = run("liger", x, head, rows, LIGER[name], chunk_elements=5 * 300)
    want = run("none", x, head, rows, LIGER[name], chunk_elements=5 * 300)
    assert len(liger_calls) == 1 and liger_calls[0].weight_VD.requires_grad == (not frozen)
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=ATOL)
    assert torch.equal(got[1], want[1]) and got[1].shape == (int(mask.sum()),)
    assert len(got[2]) == (1 if frozen else 2)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert signal.readout.lm_head.weight.grad is None


@pytest.mark.parametrize("name", ["fkl", "jsd_0.3"])
def test_liger_takes_the_rows_of_weight_one(liger, liger_calls, name):
    """A drafter's static rows with 0/1 weights: liger, which weighs every row alike, is given the rows of weight 1
    alone; loss, gradients (zero on rows of weight 0) and the argmax of every trained row equal the chunked path's
    (agreement counts those alone; an untrained row's argmax is of its padding-safe zero features on the chunked path
    and of its own features through liger)."""
    x, head, signal, mask = projected()
    B, T = mask.shape
    x_all = torch.randn(B * T, x.shape[1], generator=torch.Generator().manual_seed(7), requires_grad=True)
    rows = TeacherRows(signal, *slice_positions(B, T))
    kw = dict(chunk_elements=5 * 300, weight_N=mask.reshape(-1).float())
    got = run("liger", x_all, head, rows, LIGER[name], **kw)
    want = run("none", x_all, head, rows, LIGER[name], **kw)
    assert len(liger_calls) == 1 and liger_calls[0].student_ND.shape[0] == int(mask.sum())
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=ATOL)
    trained = mask.reshape(-1)
    assert torch.equal(got[1][trained], want[1][trained]) and got[1].shape == (B * T,)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fkl_T2", "jsd_0.3"])
def test_liger_on_cuda_equals_the_chunked_path(liger_calls, name):
    """The same comparison with liger's compiled kernels (not run in this project's CI: no GPU there)."""
    if not torch.cuda.is_available() or not _installed():
        pytest.skip("needs a CUDA device and liger-kernel (pip install -e '.[gpu]')")
    x, head, signal, mask = projected()
    x, head, mask = x.detach().cuda().requires_grad_(), head.cuda(), mask.cuda()
    signal.final_BTD, signal.readout = signal.final_BTD.cuda(), signal.readout.cuda()
    rows = TeacherRows(signal, *positions(mask, 0))
    got, want = run("liger", x, head, rows, LIGER[name]), run("none", x, head, rows, LIGER[name])
    assert len(liger_calls) == 1 and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_frozen_read_out_casts_rows_to_its_dtype(liger, liger_calls):
    """EAGLE-1 on a bf16 target: ``Frozen`` runs float32 rows through the bf16 read-out; liger is given them cast
    (bf16 logits on a CPU as the chunked path's; on a GPU liger's float32 GEMM output would be closer still)."""
    x, _, signal, mask = projected(V=96)
    signal.readout.lm_head.bfloat16()
    signal.final_BTD = signal.final_BTD.bfloat16()
    rows = TeacherRows(signal, *positions(mask, 0))
    got = run("liger", x, Frozen(signal.readout), rows, LIGER["jsd_0.3"])
    want = run("none", x, Frozen(signal.readout), rows, LIGER["jsd_0.3"])
    assert len(liger_calls) == 1 and got[2][0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2][0], want[2][0], rtol=1e-2, atol=1e-4)  # bf16 matmuls, other orders


def test_a_trained_head_of_another_dtype_is_named(liger):
    x, head, signal, mask = projected()
    with pytest.raises(ValueError, match="dtypes differ: student rows torch.float32, its projection torch.bfloat16"):
        run("liger", x, head.bfloat16(), TeacherRows(signal, *positions(mask, 0)), LIGER["fkl"])


def test_auto_uses_liger_under_autocast_too(liger, liger_calls):
    """bf16 autocast (``trainer.bf16``): liger's matmuls run in bf16 as the chunked path's do; equal up to bf16
    rounding in other summation orders."""
    x, head, signal, mask = projected(V=96)
    rows = TeacherRows(signal, *positions(mask, 0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run("auto", x, head, rows, LIGER["fkl"])
        want = run("none", x, head, rows, LIGER["fkl"])
    assert len(liger_calls) == 1
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def _capped(x, head, signal, mask):
    signal.readout = TargetLogits(signal.readout.lm_head, softcap=30.0)  # Gemma-2's final soft-capping
    return x, head, TeacherRows(signal, *positions(mask, 0)), LIGER["fkl"]


def _dense(x, head, signal, mask):
    dense = TeacherOutput(logits_BTV=signal.readout(signal.final_BTD))
    return x, head, TeacherRows(dense, *positions(mask, 0)), LIGER["fkl"]


def _with(loss_fn=LIGER["fkl"], head=None, cols=None):
    return lambda x, h, signal, mask: (x, head or h, TeacherRows(signal, *positions(mask, 0), cols), loss_fn)


# Terms liger does not compute exactly: (x, head, signal, mask) -> the term; the reason ``liger`` forced gives.
FALLBACKS = {
    "tvd": (_with(functools.partial(losses.total_variation)), "total_variation is not one liger computes"),
    "topk_fkl": (_with(functools.partial(losses.topk_forward_kl, k=5)), "topk_forward_kl is not one"),
    "jsd_beta_0": (_with(functools.partial(losses.jsd, beta=0.0)), "loss.beta=0.0: liger's jsd at beta 0 or 1"),
    "custom_loss": (_with(lambda s, t, m: losses.forward_kl(s, t, m)), "<lambda> is not one liger computes"),
    "draft_vocabulary": (_with(head=nn.Linear(32, 40, bias=False), cols=torch.arange(0, 80, 2)), "EAGLE-3's d2t"),
    "biased_head": (_with(head=nn.Linear(32, 300)), "projection is not a plain nn.Linear without bias"),
    "finished_head": (_with(head=Finished(nn.Linear(32, 300, bias=False), torch.tanh)), "not a plain nn.Linear"),
    "capped_read_out": (_capped, "read-out is not a plain lm_head"),
    "dense_teacher": (_dense, "the teacher comes as dense logits"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_auto_falls_back_where_liger_is_not_exact_and_liger_forced_says_why(liger, liger_calls, case):
    build, reason = FALLBACKS[case]
    x, head, rows, loss_fn = build(*projected())
    got = run("auto", x, head, rows, loss_fn)
    want = run("none", x, head, rows, loss_fn)
    assert not liger_calls
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    with pytest.raises(ValueError, match=f"trainer.fused_kernel=liger cannot run this loss term: .*{reason}"):
        with fused_kernel("liger"):
            chunked_divergence(x, head, rows, loss_fn)


def test_a_cross_entropy_term_falls_back(liger, liger_calls):
    """Hard labels (Medusa-2's language-modelling term) are not a distribution liger's JSD takes."""
    x, head, _, _ = projected()
    labels = torch.arange(x.shape[0]) * 7 % 300
    with fused_kernel("auto"):
        got = chunked_cross_entropy(x, head, labels, 300)
    torch.testing.assert_close(got, nn.functional.cross_entropy(head(x), labels, reduction="sum"))
    assert not liger_calls
    with pytest.raises(ValueError, match="hard labels"), fused_kernel("liger"):
        chunked_cross_entropy(x, head, labels, 300)


def test_no_rows_needs_no_kernel(liger_calls):
    """A term with no trained rows (a head whose shift leaves none) is zero on any path, ``liger`` forced or not."""
    x, head, signal, mask = projected()
    rows = TeacherRows(signal, *positions(torch.zeros_like(mask), 0))
    with fused_kernel("liger"):
        loss, pred = chunked_divergence(x[:0], head, rows, LIGER["fkl"])
    assert float(loss.detach()) == 0 and pred.shape == (0,) and not liger_calls


def test_without_cuda_or_the_interpreter_auto_is_the_chunked_path_and_liger_is_refused(monkeypatch, liger_calls):
    """Runs without liger installed: on CPU tensors, outside the Triton interpreter, no Triton kernel can run."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, head, signal, mask = projected()
    rows = TeacherRows(signal, *positions(mask, 0))
    got, want = run("auto", x, head, rows, LIGER["fkl"]), run("none", x, head, rows, LIGER["fkl"])
    assert not liger_calls and torch.equal(got[0], want[0])
    with pytest.raises(ValueError, match="fused_kernel=liger cannot run this loss term: the student rows are on cpu: "
                                         "liger's Triton kernels need CUDA.*Set trainer.fused_kernel=auto"):
        run("liger", x, head, rows, LIGER["fkl"])


def test_liger_not_installed_is_named_with_the_install_command(monkeypatch):
    """The import itself fails (a missing module): ``liger`` forced names the install command."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_jsd", None)  # import raises ModuleNotFoundError
    monkeypatch.setattr(fused_kernels, "_load_liger", fused_kernels._load_liger.__wrapped__)  # not the cached answer
    x, head, signal, mask = projected()
    rows = TeacherRows(signal, *positions(mask, 0))
    with pytest.raises(ValueError, match=r"liger-kernel cannot be imported .*pip install -e '\.\[gpu\]'"):
        run("liger", x, head, rows, LIGER["fkl"])
    assert run("auto", x, head, rows, LIGER["fkl"])[0] == run("none", x, head, rows, LIGER["fkl"])[0]


def test_an_unknown_choice_is_refused_at_start_up():
    from hydra import compose, initialize_config_dir

    from tests.test_reliability_units import CONF
    from train.config import load_config

    with pytest.raises(ValueError, match=r"trainer.fused_kernel='fast' is not a choice; valid: \['auto', 'liger', "):
        with fused_kernel("fast"):
            pass
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["trainer.fused_kernel=fast"])
    with pytest.raises(ValueError, match="trainer.fused_kernel='fast' is not a choice"):
        load_config(cfg)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        assert load_config(compose(config_name="config")).trainer.fused_kernel == "none"


# --- whole drafters whose terms liger takes: EAGLE-1 (one step: the target's frozen read-out) and a draft model --

KINDS = {
    "eagle1_one_step": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "ttt_steps": 1},
    "draft_model": {"_target_": "heads.draft_model.DraftModel"},
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("loss", ["fkl", "jsd_0.3"])
def test_drafters_train_the_same_under_auto(liger, liger_calls, tiny_teacher, kind, loss):
    drafter, batch = drafter_and_batch(KINDS[kind], tiny_teacher)
    params = [p for p in drafter.parameters() if p.requires_grad]
    results = []
    for choice in ("auto", "none"):
        signals = tiny_teacher.signals(batch, drafter.teacher_layers, dense=drafter.dense_teacher_logits)
        assert signals.projected
        with fused_kernel(choice):
            out = drafter(batch, signals, loss_fn=LIGER[loss])
        got, _ = out.loss(LIGER[loss])
        results.append((got.detach(), torch.autograd.grad(got, params), [tuple(map(int, a)) for a in
                                                                         out.top1_agreement()]))
    assert len(liger_calls) == len(out.terms) >= 1
    (loss_a, grads_a, agree_a), (loss_b, grads_b, agree_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=RTOL, atol=1e-5)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert agree_a == agree_b
