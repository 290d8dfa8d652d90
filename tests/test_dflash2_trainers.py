"""DFlash2 under every data-parallel trainer on CPU with gloo, 2 ranks: DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 train it
(backbone, convolutions, selector and its loss) to the same loss curve and weights as one process on the same
global batch, and a 2-rank run killed mid-way resumes onto the uninterrupted curve (``tests.trainer_ranks``). Every
candidate anchor is drawn, so the blocks a row trains do not depend on how rows are split over ranks. Slow, as
DFlash's (tests/test_dflash_trainers.py)."""

from __future__ import annotations

import pytest

from tests import trainer_ranks

pytestmark = pytest.mark.slow

DFLASH2 = {"_target_": "heads.dflash2.DFlash2Drafter", "block_size": 4, "num_layers": 1, "num_anchors": 64,
           "conv_group_size": 8, "selector_top_k": 4, "selector_rank": 8}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return trainer_ranks.two_ranks(tmp_path_factory.mktemp("ranks"), DFLASH2)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return trainer_ranks.single(tmp_path_factory.mktemp("single"), DFLASH2)


@pytest.mark.parametrize("engine", list(trainer_ranks.ENGINES))
def test_two_ranks_match_one_process(engine, two_ranks, single):
    trainer_ranks.assert_matches_one_process(DFLASH2, engine, two_ranks, single)


@pytest.mark.parametrize("engine", list(trainer_ranks.ENGINES))
def test_two_ranks_killed_and_resumed_follow_the_uninterrupted_curve(engine, two_ranks, single):
    trainer_ranks.assert_resumed_onto_the_curve(engine, two_ranks, single)
