"""A training micro-step makes no host syncs inside the drafters: every kind's loss rows have static shapes.

On a GPU a read-back (``.item()``, ``bool(t)``, ``.tolist()``), an op whose output shape depends on the data
(``nonzero``, ``x[mask]``) or a tensor built from Python data stalls the pipeline until the device catches up. The
drafters therefore train on every row of a term's static slice with a 0/1 weight per row (``DraftTerm.weight_N``)
instead of selecting the masked rows. ``inference.transfers.TransferCounter`` sees these syncs on a CPU too, so this
test holds the GPU budget: one non-logging micro-step (count_valid, the teacher's signals, the drafter's forward
with its loss, backward) makes none of its own; the loop's two finiteness checks (loss and grad norm) come on top.

transformers' mask creation reads the attention mask (or, without one, the position ids) back once per forward of
an HF model, to decide whether attention may run plainly causal: counted apart (``hf_mask``), for the teacher's
forward and for the drafters that run an HF model themselves (the draft model; Medusa-2's adapted target). The
teacher runs under ``torch.inference_mode``, whose ops no dispatch mode sees, so it is counted under ``no_grad``.

Run ``pytest tests/test_train_syncs.py -s`` to see the counts per kind.
"""

from __future__ import annotations

import functools
import traceback
from collections import Counter
from unittest import mock

import pytest
import torch

from distill.data import collate
from distill.losses import forward_kl
from distill.row_seeds import ROW_SEED, row_seeds
from distill.teacher import Teacher
from heads.base import build_drafter
from distill.causal import causal_attention, plain_causal
from inference.transfers import TransferCounter
from tests.conftest import make_tiny_llama

KINDS = {
    "eagle1": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "layers": [-1], "ttt_steps": 2},
    "eagle3": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "layers": [0, 1, 2], "ttt_steps": 3,
               "draft_vocab_size": 96},
    "medusa": {"_target_": "heads.medusa.MedusaHeads", "num_heads": 2, "num_layers": 1, "loss_decay": 0.8},
    "medusa2": {"_target_": "heads.medusa.Medusa2", "num_heads": 2, "num_layers": 1, "lora": {"r": 4, "alpha": 8},
                "heads_only_steps": 0},
    "dflash": {"_target_": "heads.dflash.DFlashDrafter", "block_size": 4, "num_anchors": 4},
    "dflash2": {"_target_": "heads.dflash2.DFlash2Drafter", "block_size": 4, "num_anchors": 4, "conv_group_size": 8,
                "selector_top_k": 4, "selector_rank": 8, "selector_warmup_steps": 3},
    "peagle": {"_target_": "heads.peagle.PEagleDrafter", "layers": [0, 1, 2], "num_depths": 3,
               "draft_vocab_size": 96},
    "draft_model": {"_target_": "heads.draft_model.DraftModel"},
}
SYNCS = ("item", "tolist", "sync_shape", "from_python")
KL = functools.partial(forward_kl)
_ITEM = torch.ops.aten._local_scalar_dense.default


class StepCounter(TransferCounter):
    """``TransferCounter`` that files the read-backs of transformers' mask creation apart, as ``hf_mask``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _ITEM and any(f.filename.endswith("transformers/masking_utils.py") for f in traceback.extract_stack()):
            self.counts["hf_mask"] += 1
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def packed_batch(T: int = 32, B: int = 2) -> dict:
    """B packed rows (every position real) with a partial loss mask, as the loader makes them."""
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 128, (T,), generator=g), "attention_mask": torch.ones(T, dtype=torch.long),
             "loss_mask": torch.rand(T, generator=g) < 0.8} for _ in range(B)]
    batch = collate(rows)
    batch[ROW_SEED] = row_seeds(0, 0, 0, B)
    return batch


def step_syncs(kind: str) -> tuple[Counter, Counter]:
    """(the drafter's syncs, the teacher forward's) in the second of two micro-steps (the first may fill caches and
    runs the one-off checks)."""
    teacher = Teacher(make_tiny_llama(), None, name="tiny-llama")
    drafter = build_drafter(KINDS[kind], teacher)
    drafter.bind_target(teacher, initialize=True)
    batch = packed_batch()
    for _ in range(2):
        with StepCounter() as step:
            valid = drafter.count_valid(batch)
        with StepCounter() as target, mock.patch.object(torch, "inference_mode", torch.no_grad):
            out = teacher.signals(batch, tuple(drafter.teacher_layers), dense=drafter.dense_teacher_logits)
        with step:
            loss, _ = drafter(batch, out, loss_fn=KL).loss(KL)
            (loss / valid).backward()
    keys = (*SYNCS, "hf_mask")
    return Counter({k: step.counts[k] for k in keys}), Counter({k: target.counts[k] for k in keys})


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_step_makes_no_host_syncs(kind):
    drafter, target = step_syncs(kind)
    print(f"\n{kind}: drafter {dict(drafter)} teacher {dict(target)}")
    assert sum(drafter[k] for k in SYNCS) == 0, f"{kind}'s training step syncs: {dict(drafter)}"
    # a plainly causal HF model (Llama) builds no mask (distill.causal): not even transformers' own read-back
    assert drafter["hf_mask"] == 0, f"{kind}: {dict(drafter)}"
    assert sum(target[k] for k in SYNCS) == 0 and target["hf_mask"] == 0, f"the teacher's forward: {dict(target)}"


def test_causal_forward_equals_the_masked_one_at_real_positions_and_skips_windowed_models():
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    with torch.no_grad():
        masked = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with causal_attention(model):
            assert model.config._attn_implementation == "specdraft_causal"
            causal = model(input_ids=ids, use_cache=False).logits
    assert model.config._attn_implementation == "sdpa"  # restored
    real = mask.bool()
    torch.testing.assert_close(causal[real], masked[real])
    windowed = make_tiny_llama(sliding_window=4)  # a window is more than causal: the model's own mask path
    assert not plain_causal(windowed.config)
