"""DFlash from the offline teacher: ``python -m distill.cache drafter=dflash`` stores only the feature layers the
drafter reads (not the final hidden state the other kinds take), in bfloat16, and prints the bytes per token; training
from that cache with the anchors' objective (cross-entropy on the target's tokens, read from the cached top-k) follows
the online loss curve."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from distill.cache import MANIFEST, bytes_per_token, open_teacher_cache
from distill.cache.__main__ import build_cache
from tests.test_cache import DATA_CFG, K, make_rows, run_training, write

ROOT = Path(__file__).resolve().parents[1]
# The anchors' objective, random anchors (fewer than a row has: the offline run must draw the same ones), two
# feature layers of the 2-layer target (the embeddings and layer 1) and no final hidden state.
DFLASH_CE = {"_target_": "heads.dflash.DFlashDrafter", "block_size": 4, "layers": [0, 1], "num_anchors": 8,
             "objective": "ce"}


def test_offline_ce_training_follows_the_online_loss_curve(tiny_teacher, tmp_path):
    rows, layers = make_rows(), (0, 1)
    online = run_training(tiny_teacher, rows, tmp_path / "online", drafter_cfg=DFLASH_CE)
    curves = {}
    for dtype in ("float32", "bfloat16"):
        manifest = write(tiny_teacher, tmp_path / dtype, rows, dtype=dtype, layers=layers)
        assert manifest["layers"] == [0, 1] and manifest["dtype"] == dtype
        dataset, offline = open_teacher_cache(tmp_path / dtype, tiny_teacher, DATA_CFG, layers)
        assert sorted(k for k in dataset[0] if k.startswith("hidden.")) == ["hidden.0", "hidden.1"]
        curves[dtype] = run_training(offline, dataset, tmp_path / f"run-{dtype}", drafter_cfg=DFLASH_CE)
    assert len(online) == 10 and online[-1] < online[0]
    # float32: the cached top-1 is the online argmax, so the curve is the online one
    torch.testing.assert_close(torch.tensor(curves["float32"]), torch.tensor(online), rtol=1e-5, atol=1e-6)
    # bfloat16 features round the context: the same first loss within 0.1 %, the curve within 0.5 %
    assert curves["bfloat16"][0] == pytest.approx(online[0], rel=1e-3)
    torch.testing.assert_close(torch.tensor(curves["bfloat16"]), torch.tensor(online), rtol=5e-3, atol=1e-5)


def test_cli_caches_only_the_drafters_layers_and_prints_the_bytes(tiny_toy_target, tmp_path, capsys):
    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs

    register_configs()
    overrides = ["target=tiny", "drafter=dflash", "drafter.num_layers=2", "data.max_length=64",
                 "data.corpus_max_bytes=20000", "cache.shard_rows=16", f"cache.topk={K}", "trainer.device=cpu",
                 f"cache.dir={tmp_path / 'cache'}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    manifest = build_cache(cfg)
    model, _ = tiny_toy_target
    L, D = model.config.num_hidden_layers, model.config.hidden_size
    from heads.dflash.model import default_feature_layers

    assert manifest["layers"] == list(default_feature_layers(L, 2)) and L not in manifest["layers"]
    assert manifest["dtype"] == "bfloat16"
    per_token = bytes_per_token(len(manifest["layers"]), D, K, "bfloat16")
    assert manifest["bytes_per_token"] == per_token == len(manifest["layers"]) * D * 2 + K * 8 + 6
    assert re.search(re.escape(f"layers {manifest['layers']} (D={D}, bfloat16)") + rf".*: {per_token} bytes/token, expected ",
                     capsys.readouterr().out)
    assert json.loads((tmp_path / "cache" / MANIFEST).read_text())["num_rows"] > 0


def test_dspark_offline_ce_training_follows_the_online_loss_curve(tiny_teacher, tmp_path):
    """DSpark reads the same cached feature layers and top-1 as DFlash: its loss (tokens, Markov bias, confidence)
    from a float32 cache follows the online curve."""
    node = {**DFLASH_CE, "_target_": "heads.dspark.DSparkDrafter", "markov_rank": 8}
    rows, layers = make_rows(), (0, 1)
    online = run_training(tiny_teacher, rows, tmp_path / "online", drafter_cfg=node)
    write(tiny_teacher, tmp_path / "cache", rows, dtype="float32", layers=layers)
    dataset, offline = open_teacher_cache(tmp_path / "cache", tiny_teacher, DATA_CFG, layers)
    curve = run_training(offline, dataset, tmp_path / "run", drafter_cfg=node)
    assert len(online) == 10 and online[-1] < online[0]
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(online), rtol=1e-5, atol=1e-6)


def test_dflash2_offline_ce_training_follows_the_online_loss_curve(tiny_teacher, tmp_path):
    """DFlash2 reads the same cached feature layers and top-1 as DFlash (its selector's labels are the target's top
    tokens): its loss (tokens, convolutions, selector) from a float32 cache follows the online curve."""
    node = {**DFLASH_CE, "_target_": "heads.dflash2.DFlash2Drafter", "conv_group_size": 8, "selector_top_k": 4,
            "selector_rank": 8}
    rows, layers = make_rows(), (0, 1)
    online = run_training(tiny_teacher, rows, tmp_path / "online", drafter_cfg=node)
    write(tiny_teacher, tmp_path / "cache", rows, dtype="float32", layers=layers)
    dataset, offline = open_teacher_cache(tmp_path / "cache", tiny_teacher, DATA_CFG, layers)
    curve = run_training(offline, dataset, tmp_path / "run", drafter_cfg=node)
    assert len(online) == 10 and online[-1] < online[0]
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(online), rtol=1e-5, atol=1e-6)
