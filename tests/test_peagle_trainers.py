"""P-EAGLE under every data-parallel trainer on CPU with gloo, 2 ranks: DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 train it to
the same loss curve and weights as one process on the same global batch (uneven valid-token counts per rank), and a
2-rank run killed mid-way resumes onto the uninterrupted curve (``tests.trainer_ranks``).

The chains a row trains are sampled (shares 0.7^d of its anchors, at least 0.2), from the row's seed
(``distill.row_seeds``): the same draw on one process and on any rank, and after a resume. Slow, as the other kinds'
distributed runs in ``test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch

from distill.data import collate
from distill.losses import forward_kl
from distill.row_seeds import ROW_SEED, row_seeds
from heads.base import build_drafter
from tests import trainer_ranks
from tests.test_distributed import _teacher, uneven_dataset

pytestmark = pytest.mark.slow

PEAGLE = {"_target_": "heads.peagle.PEagleDrafter", "layers": [0, 1, 2], "num_depths": 4, "num_layers": 2,
          "draft_vocab_size": None}
# ZeRO-3 partitions the trainable lm_head, so its loss runs through plain autograd on the gathered head
# (``distill.chunked``) instead of the chunk loop's hand-written gradient: the same curve (rel 1e-5), weights equal to
# rounding after Adam's steps (measured: at most 1.2e-5 apart on weights of size ~0.2).
ATOL = {"zero3": 5e-5}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return trainer_ranks.two_ranks(tmp_path_factory.mktemp("ranks"), PEAGLE)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return trainer_ranks.single(tmp_path_factory.mktemp("single"), PEAGLE)


@pytest.mark.parametrize("engine", list(trainer_ranks.ENGINES))
def test_two_ranks_match_one_process(engine, two_ranks, single):
    trainer_ranks.assert_matches_one_process(PEAGLE, engine, two_ranks, single, ATOL.get(engine, 1e-6))


@pytest.mark.parametrize("engine", list(trainer_ranks.ENGINES))
def test_two_ranks_killed_and_resumed_follow_the_uninterrupted_curve(engine, two_ranks, single):
    trainer_ranks.assert_resumed_onto_the_curve(engine, two_ranks, single, ATOL.get(engine, 1e-6))


def test_the_drawn_chains_change_the_loss():
    """The runs above sample: on the data they train on, other seeds draw other chains and another loss, so matching
    curves mean matching draws (not a draw that takes every anchor)."""
    teacher = _teacher()
    torch.manual_seed(0)
    drafter = build_drafter(PEAGLE, teacher)
    drafter.bind_target(teacher, initialize=True)
    batch = collate(uneven_dataset()[:4])
    signals = teacher.signals(batch, drafter.teacher_layers)
    anchors = drafter.train_mask(batch, 1).sum(1)
    assert drafter.depth_counts(int(anchors.max()))[0] < int(anchors.max())  # fewer chains than anchors

    def loss(step):
        batch[ROW_SEED] = row_seeds(0, step, 0, 4)
        with torch.no_grad():
            total, n = drafter(batch, signals).loss(forward_kl)
        return float(total / n)

    assert loss(0) == loss(0) and loss(0) != loss(1)
