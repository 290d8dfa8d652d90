"""``trainer.attention`` (heads/train_attention.py): the drafters' structured training masks as mask_mods, and the
kernels that run them. The dense kernel (one SDPA call under the whole mask) is the reference: the mask_mods equal
the dense masks built tensor by tensor, the tiled kernel equals the dense one in outputs and gradients, flex's
forward equals it, and every drafter kind's loss and gradients are the same under each kernel."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import heads.train_attention as ta
from distill.losses import forward_kl
from distill.teacher import Teacher
from heads.base import build_drafter
from heads.train_attention import (attend, dflash_block_mask, kernel_for, parallel_chain_mask, train_attention,
                                   ttt_step_mask)
from tests.drafters import DFLASH_NODE, EAGLE1_NODE, EAGLE3_NODE, PEAGLE_NODE, tiny_llama
from tests.families import FAMILIES
from train.engine import TrainerConfig

KL = functools.partial(forward_kl, temperature=1.0)


# --- the dense masks as they are built tensor by tensor (the reference the mask_mods must equal) -----------------

def reference_ttt_mask(attn_BT, steps):
    B, T = attn_BT.shape
    pos = torch.arange(T)
    causal = (pos[None, :] <= pos[:, None])[None] & (attn_BT[:, None, :] | torch.eye(T, dtype=torch.bool))
    mask = torch.zeros(B, 1, T, steps * T, dtype=torch.bool)
    mask[:, 0, :, :T] = causal
    for i in range(1, steps):
        mask[:, 0, :, i * T: (i + 1) * T].diagonal(dim1=-2, dim2=-1).fill_(True)
    return mask


def reference_block_mask(anchors_BN, attn_BT, S, window=None):
    B, N = anchors_BN.shape
    T = attn_BT.shape[1]
    ctx = torch.arange(T)
    sees_ctx = (ctx[None, None, :] < anchors_BN[..., None]) & attn_BT[:, None, :]
    sees_ctx = sees_ctx[:, :, None, :].expand(B, N, S, T)
    if window is not None:
        pos_q = anchors_BN[..., None] + torch.arange(S)
        sees_ctx = sees_ctx & ((pos_q[..., None] - ctx) < window)
    sees_ctx = sees_ctx.reshape(B, N * S, T)
    blk = torch.arange(N).repeat_interleave(S)
    same = (blk[:, None] == blk[None, :])[None].expand(B, -1, -1)
    return torch.cat([sees_ctx, same], -1)[:, None]


def reference_parallel_mask(attn_BT, anchors_BN, counts):
    B, T = attn_BT.shape
    Q = T + sum(counts)
    t = torch.arange(T)
    mask = torch.zeros(B, Q, Q, dtype=torch.bool)
    mask[:, :T, :T] = (t[None, :] <= t[:, None])[None] & (attn_BT[:, None, :] | torch.eye(T, dtype=torch.bool))
    if not sum(counts):
        return mask[:, None]
    chain = torch.cat([torch.arange(n) for n in counts])
    depth = torch.cat([torch.full((n,), d) for d, n in enumerate(counts, start=1)])
    anchor = anchors_BN[:, chain]
    mask[:, T:, :T] = (t[None, None, :] <= anchor[..., None]) & attn_BT[:, None, :]
    mask[:, T:, T:] = ((chain[:, None] == chain[None, :]) & (depth[None, :] <= depth[:, None]))[None]
    return mask[:, None]


def padded(B, T, left=False, seed=0):
    """[B, T] bool: row 0 full, the others padded by a random amount (on the right, or the left)."""
    g = torch.Generator().manual_seed(seed)
    attn = torch.ones(B, T, dtype=torch.bool)
    for b in range(1, B):
        n = int(torch.randint(T // 2, T, (1,), generator=g))
        attn[b] = torch.arange(T) >= T - n if left else torch.arange(T) < n
    return attn


def anchors(B, N, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(T - 2, generator=g)[:N].sort().values + 1 for _ in range(B)])


def masks(left: bool = False):
    """(name, StructuredMask) for every mask kind, on 3 rows of 23 tokens (odd sizes: partial tiles)."""
    B, T = 3, 23
    attn = padded(B, T, left)
    anc = anchors(B, 4, T)
    out = [(f"ttt{j}", ttt_step_mask(attn, j, right_padded=not left)) for j in range(4)]
    out += [(f"dflash-window{w}", dflash_block_mask(anc, attn, 5, w)) for w in (None, 6)]
    out += [(f"peagle{c}", parallel_chain_mask(attn, anc, c, right_padded=not left)) for c in ([], [4, 3, 1], [2])]
    return attn, out


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_mask_mods_equal_the_dense_masks(left):
    attn, built = masks(left)
    anc = anchors(3, 4, 23)
    want = {f"ttt{j}": reference_ttt_mask(attn, j + 1) for j in range(4)}
    want.update({f"dflash-window{w}": reference_block_mask(anc, attn, 5, w) for w in (None, 6)})
    want.update({f"peagle{c}": reference_parallel_mask(attn, anc, c) for c in ([], [4, 3, 1], [2])})
    for name, mask in built:
        assert torch.equal(mask.dense(torch.device("cpu")), want[name]), name


def qkv(mask, seed=0, hd=8, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(mask.B, 2, n, hd, generator=g, dtype=torch.float32).requires_grad_(requires_grad)
    return make(mask.Q), make(mask.KV), make(mask.KV)


def real_queries(name, mask, attn):
    """[B, 1, Q, 1] bool: the queries whose outputs must agree (the padded ones of a right-padded causal prefix see
    padding; nothing reads them)."""
    keep = torch.ones(mask.B, 1, mask.Q, 1, dtype=torch.bool)
    if mask.right_padded and mask.causal_prefix:
        keep[:, 0, : mask.causal_prefix, 0] = attn[:, : mask.causal_prefix]
    return keep


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_tiled_equals_dense_in_outputs_and_gradients(left, monkeypatch):
    monkeypatch.setattr(ta, "TILE", 4)  # several tiles, the last one partial
    attn, built = masks(left)
    for name, mask in built:
        q, k, v = qkv(mask)
        keep = real_queries(name, mask, attn)
        grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)) * keep
        outs = {}
        for kernel in ("dense", "tiled"):
            with train_attention(kernel):
                out = attend(q, k, v, mask)
            outs[kernel] = (out * keep, *torch.autograd.grad(out, (q, k, v), grad))
        for want, got in zip(outs["dense"], outs["tiled"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_equals_dense(monkeypatch):
    """The mask_mods through flex attention (eager here: compiling on a CPU takes minutes; the compiled kernel runs
    in the slow test below and on GPUs). No gradient: flex has no backward on a CPU."""
    monkeypatch.setattr(ta, "FLEX_COMPILE", False)
    attn, built = masks()
    for name, mask in built:
        q, k, v = qkv(mask, requires_grad=False)
        keep = real_queries(name, mask, attn)
        with train_attention("dense"):
            want = attend(q, k, v, mask)
        with train_attention("flex"):
            got = attend(q, k, v, mask)
        torch.testing.assert_close(got * keep, want * keep, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_compiled_flex_forward_equals_dense():
    attn = padded(2, 40)
    mask = parallel_chain_mask(attn, anchors(2, 5, 40), [5, 2])
    q, k, v = qkv(mask, hd=16, requires_grad=False)
    with torch.no_grad(), train_attention("dense"):
        want = attend(q, k, v, mask)
    with torch.no_grad(), train_attention("flex"):
        got = attend(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_choice_and_its_errors():
    cpu = torch.device("cpu")
    assert kernel_for(cpu, needs_grad=True) == "tiled"  # auto
    with train_attention("dense"):
        assert kernel_for(cpu, needs_grad=True) == "dense"
    with train_attention("flex"):
        assert kernel_for(cpu, needs_grad=False) == "flex"
        with pytest.raises(ValueError, match="trainer.attention=flex needs CUDA to train.*auto or tiled"):
            kernel_for(cpu, needs_grad=True)
    with pytest.raises(ValueError, match=r"trainer.attention='sparse' is not a choice; valid: \['auto', 'flex'"):
        train_attention("sparse").__enter__()
    assert TrainerConfig().attention == "auto"
    mask = ttt_step_mask(torch.ones(1, 6, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="mask built for B=1, Q=6, KV=12"):
        attend(*qkv(ttt_step_mask(torch.ones(1, 5, dtype=torch.bool), 1)), mask)


def test_the_trainer_config_refuses_an_unknown_kernel():
    from train.config import _check_schedule

    with pytest.raises(ValueError, match="trainer.attention='fast' is not a choice"):
        _check_schedule(TrainerConfig(attention="fast"))


# --- every drafter kind: the same loss and gradients under each kernel --------------------------------------------

def batch(B=2, T=26, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (B, T), generator=g)
    attn = padded(B, T, seed=seed).long()
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": torch.rand(B, T, generator=g) > 0.2}


LAYERS = {"layers": [1, 2, 2]}  # three feature layers of the 2-layer tiny target
CASES = {
    "eagle1": EAGLE1_NODE,
    **{f"eagle3-ttt{s}": {**EAGLE3_NODE, **LAYERS, "ttt_steps": s} for s in (1, 2, 4, 7)},
    "dflash": DFLASH_NODE,
    "dflash-window": {**DFLASH_NODE, "sliding_window": 7},
    "peagle-depth2": {**PEAGLE_NODE, **LAYERS, "num_depths": 2},
    "peagle-depth4-upper2": {**PEAGLE_NODE, **LAYERS, "num_depths": 4, "num_layers": 3},
    "eagle3-ttt4-window": {**EAGLE3_NODE, **LAYERS, "ttt_steps": 4, "sliding_window": 6},
    "peagle-depth4-window": {**PEAGLE_NODE, **LAYERS, "num_depths": 4, "num_layers": 2, "sliding_window": 5},
}


def loss_and_grads(node, teacher, data, kernel):
    torch.manual_seed(0)
    drafter = build_drafter(node, teacher)
    drafter.bind_target(teacher, initialize=True)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    with train_attention(kernel):
        torch.manual_seed(1)  # DFlash draws its anchors from the global generator
        total, n = drafter(data, teacher.signals(data, drafter.teacher_layers)).loss(KL)
        return [total / n, *torch.autograd.grad(total / n, params)]


@pytest.mark.parametrize("case", list(CASES))
def test_every_drafter_trains_the_same_under_each_kernel(tiny_teacher, case):
    data = batch()
    want = loss_and_grads(CASES[case], tiny_teacher, data, "dense")
    for kernel in ("tiled", "auto"):  # auto on a CPU: tiled, and EAGLE's explicit path for short rows
        got = loss_and_grads(CASES[case], tiny_teacher, data, kernel)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{case} under {kernel}")


# --- the HF forwards: no mask for right-padded rows -------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_teacher_without_a_mask_equals_the_masked_forward_at_real_positions(family):
    """Right-padded rows longer than the sliding window of the sliding-window families: the forward without a mask
    (what ``Teacher.signals`` runs) equals the masked one at every real position, logits and hidden states."""
    torch.manual_seed(0)
    teacher = Teacher(FAMILIES[family].build(), tokenizer=None, name=family)
    ids = torch.randint(3, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    attn = padded(2, 30, seed=3).long()
    layers = (1, -1)
    want = teacher(ids, attn, layers)
    got = teacher.signals({"input_ids": ids, "attention_mask": attn}, layers)
    real = attn.bool()
    torch.testing.assert_close(got.logits_BTV[real], want.logits_BTV[real], rtol=1e-4, atol=1e-4)
    for i in layers:
        torch.testing.assert_close(got.hidden[i][real], want.hidden[i][real], rtol=1e-4, atol=1e-4)


def masked_forward(model, data):
    """``model``'s forward with the batch's attention mask put back (the reference for the unmasked training
    forwards)."""
    plain = model.forward

    def forward(*args, **kwargs):
        kwargs.setdefault("attention_mask", data["attention_mask"])
        return plain(*args, **kwargs)

    return forward


def test_draft_model_and_medusa2_train_the_same_without_the_mask(monkeypatch):
    """Their training forwards run the HF model on right-padded rows without the mask: the same loss and gradients
    as with it (Medusa-2 in its joint stage, its LoRA trained through the target's forward)."""
    from heads.draft_model.model import DraftModel
    from tests.drafters import DIMS

    data = batch()
    medusa2 = {"_target_": "heads.medusa.Medusa2", "num_heads": 3, "num_layers": 1, "tree": "small",
               "lora": {"r": 4, "alpha": 8}, "heads_only_steps": 0}
    for kind in ("draft_model", "medusa2"):
        runs = []
        for masked in (True, False):
            torch.manual_seed(0)
            teacher = Teacher(tiny_llama(), tokenizer=None, name="tiny")  # medusa2 puts its LoRA into the target
            drafter = (DraftModel(DIMS, model=tiny_llama(seed=1, num_hidden_layers=1)) if kind == "draft_model"
                       else build_drafter(medusa2, teacher))
            drafter.bind_target(teacher, initialize=True)
            drafter.train()
            drafter.begin_step(0)
            model = drafter.model if kind == "draft_model" else drafter._frozen["model"]
            if masked:
                monkeypatch.setattr(model, "forward", masked_forward(model, data))
            params = [p for p in drafter.parameters() if p.requires_grad]
            total, n = drafter(data, teacher(data["input_ids"], data["attention_mask"])).loss(KL)
            runs.append([total, *torch.autograd.grad(total, params)])
            monkeypatch.undo()
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=kind)


def test_training_rows_must_be_right_padded():
    from distill.data import TokenBlockDataset

    ids = torch.zeros(2, 5, dtype=torch.long)
    attn = torch.ones(2, 5, dtype=torch.long)
    TokenBlockDataset(ids, attn, attn.bool())
    attn[1, :2] = 0
    with pytest.raises(ValueError, match="attention_mask: row 1 has a real token after padding.*pad on the right"):
        TokenBlockDataset(ids, attn, attn.bool())
