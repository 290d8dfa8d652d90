"""Settings checked at start-up: typed drafter keys, and settings a run or a resume would otherwise take without a
word."""

from __future__ import annotations

import pytest

from heads.base import build_drafter
from tests.test_reliability_units import load
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
