"""FLOP counts from shapes (``distill.flops``, ``heads.flops``) against ``torch.utils.flop_counter`` on real training
steps of every drafter kind, and the ``model`` attention convention against the reference masks' allowed pairs."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

import heads.eagle.model
from distill.flops import LMShape, TargetShape, causal_pairs
from distill.losses import forward_kl
from distill.teacher import Teacher
from heads.base import build_drafter
from heads.base import TargetDims
from heads.draft_model.model import DraftModel
from heads.train_attention import train_attention
from tests.drafters import NODES, tiny_llama
from train.flops import FlopMeter, device_peak_tflops

DIMS = TargetDims(hidden_size=32, vocab_size=128, num_layers=4)

aten = torch.ops.aten
# torch.utils.flop_counter's formulas, plus three it lacks: the in-place addmm_ (a chunked loss accumulates a trainable
# head's weight gradient with it), the grouped matmul of mixture-of-experts banks ([rows, K] by [E, K, N], each row
# through one expert) and a CPU's scaled_dot_product_attention, the flash-for-CPU op (the formulas of the GPU
# kernels: the whole [queries x keys] product per call).
FORMULAS = {**flop_registry, aten.addmm_: flop_registry[aten.addmm],
            aten._grouped_mm: shape_wrapper(lambda a, b, *args, out_shape=None, **kwargs: 2 * a[0] * a[1] * b[-1]),
            aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(
                lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)),
            aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(
                lambda g, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(g, q, k, v))}


class FlopCounter(TorchDispatchMode):
    """``FlopCounterMode``'s count without its module tracker, whose backward hooks refuse the ``autograd.grad`` a
    chunked loss runs inside a module's forward (Medusa heads)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = FORMULAS.get(func.overloadpacket)
        if formula is None:  # as FlopCounterMode: a composite op (e.g. linear under inference mode) decomposed
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out
MEDUSA2_NODE = {"_target_": "heads.medusa.Medusa2", "num_heads": 3, "num_layers": 1, "heads_only_steps": 0}
KINDS = {**NODES, "eagle3_ttt1": {**NODES["eagle3"], "ttt_steps": 1}, "eagle3_full_vocab": {
    **NODES["eagle3"], "draft_vocab_size": None, "ttt_steps": 3}, "eagle1_ttt3": {**NODES["eagle1"], "ttt_steps": 3},
    "dflash_distill": {**NODES["dflash"], "objective": "distill"}, "medusa2": MEDUSA2_NODE,
    "eagle3": {**NODES["eagle3"], "ttt_steps": 3}, "peagle_full_vocab": {**NODES["peagle"], "draft_vocab_size": None}}


SIZES = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)  # grouped keys and values


def _teacher() -> Teacher:
    return Teacher(tiny_llama(initializer_range=0.2, **SIZES), tokenizer=None, name="tiny")


def _drafter(kind: str, teacher: Teacher, **node):
    if kind == "draft_model":
        drafter = DraftModel(DIMS, model=tiny_llama(seed=1, **{**SIZES, "num_hidden_layers": 1}))
        drafter.bind_target(teacher, initialize=False)
        return drafter.train()
    torch.manual_seed(0)
    drafter = build_drafter({**KINDS[kind], **node}, teacher)
    drafter.bind_target(teacher, initialize=True)
    return drafter.train()


def _step(teacher, drafter, batch, loss_fn) -> None:
    """One micro-batch as ``train.loop`` runs it: teacher signals, the drafter's forward with its loss, backward."""
    out = teacher.signals(batch, tuple(drafter.teacher_layers), dense=drafter.dense_teacher_logits)
    loss, _ = drafter(batch, out, loss_fn=loss_fn).loss(loss_fn)
    loss.backward()


def measured(teacher, drafter, B: int, T: int) -> float:
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, teacher.vocab_size, (B, T), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "row_seed": torch.arange(B)}
    loss_fn = functools.partial(forward_kl, temperature=1.0)
    _step(teacher, drafter, batch, loss_fn)  # first batch: the teacher's one-off read-out checks
    with FlopCounter() as counter:
        _step(teacher, drafter, batch, loss_fn)
    return counter.flops


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("T", [24, 64])
def test_dense_count_matches_the_flop_counter(kind, T, monkeypatch):
    # EAGLE's small-CPU attention path computes explicit scores whose per-step columns flop_counter cannot see: run
    # the fused kernel, which the dense convention describes.
    monkeypatch.setattr(heads.eagle.model, "EXPLICIT_ATTENTION_ELEMENTS", 0)
    teacher = _teacher()
    drafter = _drafter(kind, teacher)
    B = 2
    # the dense convention is every attention call's whole [Q, KV] product: the reference kernel's (the tiled and
    # flex kernels skip what the mask hides, which the model convention counts)
    with train_attention("dense"):
        got = measured(teacher, drafter, B, T)
    want = drafter.train_flops(TargetShape.of(teacher), B, T).total.dense
    assert want == pytest.approx(got, rel=0.05), (kind, T, want / got)


# --- the model convention: the pairs the reference masks allow ------------------------------------------------------
def _per_pair(drafter_heads: int, head_dim: int) -> float:
    """Model FLOPs of one allowed (query, key) pair in every head: q.k and p.v forward, twice that backward."""
    return drafter_heads * 4 * head_dim * 3


@pytest.mark.parametrize("window", [None, 2, 4])
def test_eagle_model_attention_counts_the_ttt_mask_pairs(window):
    from heads.train_attention import ttt_step_mask

    teacher = _teacher()
    drafter = _drafter("eagle3", teacher, sliding_window=window)  # 3 TTT steps
    B, T = 2, 10
    attn = torch.ones(B, T, dtype=torch.bool)
    allowed = sum(int(ttt_step_mask(attn, j, right_padded=False, window=window).dense(attn.device).sum())
                  for j in range(drafter.ttt_steps))
    got = drafter.train_flops(TargetShape.of(teacher), B, T).drafter.attn_model
    assert got == allowed * _per_pair(drafter.layer.num_heads, drafter.layer.head_dim)


@pytest.mark.parametrize("anchors, window", [(512, None), (512, 8), (4, None)])
def test_dflash_model_attention_counts_the_block_mask_pairs(anchors, window):
    from heads.dflash.model import block_mask

    teacher = _teacher()
    torch.manual_seed(0)
    drafter = build_drafter({**KINDS["dflash"], "num_anchors": anchors, "sliding_window": window}, teacher)
    B, T = 2, 12
    attn = torch.ones(B, T, dtype=torch.bool)
    cand = drafter._candidates({"attention_mask": attn, "loss_mask": attn})
    draws = 1 if anchors >= T else 400  # sampled anchors: the count is the mean over draws
    allowed = sum(int(block_mask(drafter._draw_anchors(cand)[0], attn, drafter.block_size, window).sum())
                  for _ in range(draws)) / draws
    attn_cfg = drafter.layers[0].self_attn
    got = drafter.train_flops(TargetShape.of(teacher), B, T).drafter.attn_model
    want = allowed * _per_pair(attn_cfg.h, attn_cfg.hd) * len(drafter.layers)
    assert got == pytest.approx(want, rel=0 if draws == 1 else 0.02)


@pytest.mark.parametrize("window", [None, 3])
def test_peagle_model_attention_counts_the_parallel_mask_pairs(window):
    from heads.train_attention import parallel_chain_mask

    teacher = _teacher()
    drafter = _drafter("peagle", teacher, sliding_window=window)
    B, T = 2, 12
    counts = drafter.depth_counts(T - 3)  # a full row's anchors: positions 0 .. T-4
    attn = torch.ones(B, T, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    draws = 400
    allowed = sum(int(parallel_chain_mask(attn, torch.stack([torch.randperm(T - 3, generator=g)[: counts[0]]
                                                             for _ in range(B)]), counts, right_padded=False,
                                          window=window).dense(attn.device).sum())
                  for _ in range(draws)) / draws
    got = drafter.train_flops(TargetShape.of(teacher), B, T).drafter.attn_model
    layers = 1 + len(drafter.upper)
    assert got == pytest.approx(allowed * _per_pair(drafter.layer.num_heads, drafter.layer.head_dim) * layers,
                                rel=0.02)


def test_target_model_attention_is_causal_and_forward_only():
    teacher = _teacher()
    lm = TargetShape.of(teacher).lm
    B, T = 2, 16
    allowed = int(torch.ones(T, T).tril().sum()) * B
    got = lm.forward(B, T).attn_model
    assert got == allowed * lm.num_heads * 4 * lm.head_dim * len(lm.layers)
    assert got == pytest.approx(lm.forward(B, T).attn_dense * causal_pairs(T) / T ** 2)


def test_model_attention_of_a_sliding_window_counts_the_window():
    assert causal_pairs(6, window=2) == int((torch.ones(6, 6).tril() - torch.ones(6, 6).tril(-2)).sum())
    assert causal_pairs(6, window=10) == causal_pairs(6)


# --- the loop's figures ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H800", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10G", 125.0),
    ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA B200", 2250.0),
    ("AMD Instinct MI300X", 1307.4), ("Some Future Accelerator", None),
])
def test_peak_is_matched_on_the_device_name(name, peak, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_tflops(torch.device("cuda", 0)) == peak
    assert device_peak_tflops(torch.device("cuda", 0), override=500.0) == 500.0


def test_no_peak_on_a_cpu_unless_given():
    assert device_peak_tflops(torch.device("cpu")) is None
    assert device_peak_tflops(torch.device("cpu"), override=2.0) == 2.0


def test_meter_counts_each_shape_once_and_reports_all_ranks(monkeypatch):
    teacher = _teacher()
    drafter = _drafter("medusa", teacher)
    calls = []
    count = drafter.train_flops
    monkeypatch.setattr(drafter, "train_flops", lambda *a: calls.append(a[1:]) or count(*a))
    meter = FlopMeter(drafter, teacher, world_size=2, peak_tflops=1e-6)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    for _ in range(3):
        meter.add(batch)
    meter.add({"input_ids": torch.zeros(1, 16, dtype=torch.long)})
    assert calls == [(2, 16), (1, 16)]
    step = count(TargetShape.of(teacher), 2, 16)
    flops = 3 * step.total.model + count(TargetShape.of(teacher), 1, 16).total.model
    two_ranks = lambda t: t * 2  # another rank counted the same
    got = meter.metrics(window_s=2.0, run_s=4.0, all_reduce_sum=two_ranks, device=torch.device("cpu"))
    assert got["perf/tflops"] == pytest.approx(flops * 2 / 2.0 / 1e12)
    assert got["perf/tflops_mean"] == pytest.approx(flops * 2 / 4.0 / 1e12)
    assert got["perf/mfu"] == pytest.approx(got["perf/tflops"] / (2 * 1e-6))
    assert 0 < got["perf/teacher_flops_share"] < 1
    later = meter.metrics(window_s=1.0, run_s=5.0, all_reduce_sum=two_ranks, device=torch.device("cpu"))
    assert later["perf/tflops"] == 0  # the window restarts at each report


def test_training_logs_tflops_and_mfu_only_with_a_peak(tiny_teacher, tmp_path):
    from tests.test_checkpoint import make_cfg, run

    for name, peak in (("cpu", None), ("given", 1e-4)):
        cfg = make_cfg(steps=2, peak_tflops=peak)
        run(tiny_teacher, tmp_path / name, cfg)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        logged = [r for r in rows if "perf/tokens_per_s" in r]
        assert logged and all(r["perf/tflops"] > 0 and 0 < r["perf/teacher_flops_share"] < 1 for r in logged)
        assert all(("perf/mfu" in r) == (peak is not None) for r in logged)
        if peak is not None:
            assert logged[-1]["perf/mfu_mean"] == pytest.approx(logged[-1]["perf/tflops_mean"] / peak)


def test_the_speed_guide_lists_every_peak():
    from pathlib import Path

    from train.flops import PEAK_TFLOPS

    guide = (Path(__file__).resolve().parents[1] / "docs" / "training-speed.md").read_text()
    peaks = guide.split("**Peaks.**")[1].split("\n\n")[0]
    for _, peak in PEAK_TFLOPS:
        assert f" {round(peak)}" in peaks, peak


def _family(name: str):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    if name == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**sizes, num_key_value_heads=2, num_local_experts=4,
                                                num_experts_per_tok=2))
    if name == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                                                  num_experts=8, num_experts_per_tok=2))
    if name == "gpt_neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(**sizes))
    return Gemma2ForCausalLM(Gemma2Config(**sizes, num_key_value_heads=2, head_dim=8, sliding_window=8))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_neox", "gemma2"])
def test_target_forward_of_other_families_matches_the_flop_counter(family):
    """Expert banks (top_k of E per token), fused projections and plain MLPs, alternating sliding windows."""
    model = _family(family).eval()
    B, T = 2, 32
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounter() as counter:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    lm = LMShape.of(model)
    assert (lm.forward(B, T) + lm.lm_head(B * T)).dense == pytest.approx(counter.flops, rel=0.05)
    if family == "gemma2":  # its sliding layers see fewer keys in the model convention
        assert lm.windows[0] == 8 and lm.forward(B, T).attn_model < lm.forward(B, T).attn_dense * causal_pairs(T) / T**2


def test_an_offline_cache_costs_no_target_forward():
    lm = TargetShape.of(_teacher()).lm
    offline = TargetShape(lm, online=False, can_project=lambda: False)
    assert offline.form(dense=True) == offline.form(dense=False) == "sparse"
    assert offline.signals(2, 16, "sparse").dense == 0


def test_the_report_carries_the_training_run_means():
    from eval.run import _training_perf

    final = {"train/loss": 1.0, "perf/tflops_mean": 3.0, "perf/mfu_mean": 0.25, "perf/teacher_flops_share": 0.4}
    assert _training_perf(final) == {"training_perf": {"tflops": 3.0, "mfu": 0.25, "teacher_flops_share": 0.4}}
    assert _training_perf({"train/loss": 1.0}) == {}


def test_a_schedule_stage_is_counted_apart():
    teacher = _teacher()
    torch.manual_seed(0)
    drafter = build_drafter({**KINDS["eagle3"], "ttt_warmup_steps": 2}, teacher)
    drafter.bind_target(teacher, initialize=True)
    target = TargetShape.of(teacher)
    drafter.begin_step(0)
    warm = (drafter.flops_stage, drafter.train_flops(target, 2, 16).total.model)
    drafter.begin_step(2)
    full = (drafter.flops_stage, drafter.train_flops(target, 2, 16).total.model)
    assert warm[0] != full[0] and warm[1] < full[1]
