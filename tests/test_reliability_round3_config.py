"""Settings checked at start-up: typed drafter keys, and settings a run or a resume would otherwise take without a
word."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from heads.base import build_drafter
from tests.test_checkpoint import DFLASH, Killed, make_cfg, make_dataset
from tests.test_reliability_units import _killed, load
from train.config import load_config


@pytest.mark.parametrize("text, value", [("no", False), ("off", False), ("false", False), ("yes", True), ("on", True)])
def test_drafter_booleans_written_as_words_are_stored_as_booleans(tiny_teacher, text, value):
    cfg = load_config(load("drafter=eagle3", f"drafter.fc_norm={text}", f"drafter.norm_output={text}"))
    assert cfg.drafter["fc_norm"] is value and cfg.drafter["norm_output"] is value  # never the string
    drafter = build_drafter(cfg.drafter, tiny_teacher)
    assert drafter.fc_norm_on is value and drafter.norm_output is value
    assert hasattr(drafter, "fc_norm") is value


@pytest.mark.parametrize("override, match", [
    ("drafter.fc_norm=maybe", r"^drafter.fc_norm='maybe' is not a boolean; set drafter.fc_norm=true or "),
    ("drafter.fc_norm=2", r"^drafter.fc_norm=2 is not a boolean"),
    ("drafter.num_heads=2.5", r"^drafter.num_heads=2.5 is not an integer"),
    ("drafter.rope_theta=fast", r"^drafter.rope_theta='fast' is not a number"),
    ("drafter.layers=[1,x]", r"^drafter.layers\[1\]='x' is not an integer"),
    ("drafter.layers=3", r"^drafter.layers=3 is not a list; set drafter.layers=\[...\]"),
])
def test_typed_drafter_keys_that_do_not_convert_are_refused(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(load("drafter=eagle3", override))


def test_typed_drafter_keys_are_converted_to_their_declared_types():
    cfg = load_config(load("drafter=medusa", "drafter.num_heads='3'", "drafter.loss_decay=1"))
    assert cfg.drafter["num_heads"] == 3 and isinstance(cfg.drafter["num_heads"], int)
    assert cfg.drafter["loss_decay"] == 1.0 and isinstance(cfg.drafter["loss_decay"], float)
    # A drafter taking its base's keys through **kwargs (DSpark over DFlash) is typed by the base's signature.
    cfg = load_config(load("drafter=dspark", "drafter.block_size='4'", "drafter.confidence_head=off"))
    assert cfg.drafter["block_size"] == 4 and cfg.drafter["confidence_head"] is False
    with pytest.raises(ValueError, match=r"^drafter.num_anchors='many' is not an integer"):
        load_config(load("drafter=dspark", "drafter.num_anchors=many"))


# --- settings a run or a resume took without a word ----------------------------------------------------------------


def test_a_dflash_block_larger_than_the_rows_is_refused_naming_both_keys(tiny_teacher):
    from distill.data import TokenBlockDataset

    rows = TokenBlockDataset(torch.randint(0, 128, (4, 16)), torch.ones(4, 16, dtype=torch.long),
                             torch.ones(4, 16, dtype=torch.bool))
    build_drafter({**DFLASH, "block_size": 16}, tiny_teacher).prepare(rows)  # a block as long as a row fits
    with pytest.raises(ValueError, match=r"^drafter.block_size=17 is larger than the training rows "
                                         r"\(data.max_length=16 tokens\).*raise data.max_length$"):
        build_drafter({**DFLASH, "block_size": 17}, tiny_teacher).prepare(rows)


def test_resume_with_other_eval_rows_is_refused_naming_the_key(tiny_teacher, tmp_path):
    cfg = make_cfg(eval_rows=8)
    with pytest.raises(Killed):
        _killed(tiny_teacher, tmp_path, cfg)
    cfg.trainer = replace(cfg.trainer, eval_rows=16)
    with pytest.raises(ValueError, match=r"trained with trainer.eval_rows=8, this run asks for 16.*restore "
                                         r"trainer.eval_rows=8"):
        _killed(tiny_teacher, tmp_path, cfg, dataset=make_dataset())


@pytest.mark.parametrize("compile, warned", [("on", True), ("off", False)])
def test_a_compiled_resume_says_it_is_not_bit_exact(tiny_teacher, tmp_path, caplog, compile, warned):
    cfg = make_cfg()
    with pytest.raises(Killed):
        _killed(tiny_teacher, tmp_path, cfg)
    cfg.trainer = replace(cfg.trainer, compile=compile, compile_backend="aot_eager")
    with caplog.at_level(logging.WARNING):
        _killed(tiny_teacher, tmp_path, cfg, dataset=make_dataset())
    lines = [r.getMessage() for r in caplog.records if "not bit-exact" in r.getMessage()]
    assert len(lines) == int(warned) and all("trainer.compile=off" in line and "\n" not in line for line in lines)
