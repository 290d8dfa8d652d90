"""Offline teacher cache (distill.cache): write -> read equals the online teacher, offline training follows the
online loss curve, interrupted writes resume to the same bytes, bad caches fail with messages that name the fix."""

import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distill.cache import (
    MANIFEST,
    CachedDataset,
    STORE_DTYPES,
    OfflineTeacher,
    bytes_per_token,
    open_teacher_cache,
    shard_name,
    write_cache,
)
from distill.cache.__main__ import build_cache
from distill.data import DataConfig, TokenBlockDataset, collate
from distill.losses import topk_forward_kl
from distill.teacher import TargetConfig, Teacher
from heads.base import build_drafter
from tests.conftest import make_tiny_llama
from train.config import Config
from train.engine import SingleEngine, TrainerConfig
from train.logger import LoggerConfig, MetricsLogger
from train.loop import train

ROOT = Path(__file__).resolve().parents[1]
N, T, K = 10, 16, 16
DATA_CFG = DataConfig(source="file", path="rows.jsonl", max_length=T)
MEDUSA = {"_target_": "heads.medusa.MedusaHeads", "num_heads": 2, "num_layers": 1, "loss_decay": 0.8}
# EAGLE-3 over the full vocabulary (a reduced one would take the top k inside the draft vocabulary online but of the
# whole vocabulary offline), three feature layers, a 3-step training-time test.
EAGLE3 = {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "layers": [0, 1, 2], "ttt_steps": 3,
          "draft_vocab_size": None}
# Random anchors (fewer than a row has): the offline run must draw the same ones from the same seed.
DFLASH = {"_target_": "heads.dflash.DFlashDrafter", "block_size": 4, "layers": [1], "num_anchors": 8,
          "objective": "distill"}
# P-EAGLE: EAGLE-3's features, three parallel depths over randomly sampled chains (the same ones from the same seed).
PEAGLE = {"_target_": "heads.peagle.PEagleDrafter", "layers": [0, 1, 2], "num_depths": 3, "draft_vocab_size": None}


def make_rows(n=N):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (n, T), generator=g)
    loss_mask = torch.rand(n, T, generator=g) > 0.2
    return TokenBlockDataset(ids, torch.ones_like(ids), loss_mask)


def write(teacher, path, rows=None, **kwargs):
    kwargs = {"topk": K, "dtype": "float32", "shard_rows": 4, "batch_size": 2, **kwargs}
    return write_cache(path, teacher, rows or make_rows(), DATA_CFG, kwargs.pop("layers", (-1,)), **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_round_trip_matches_the_online_teacher(tiny_teacher, tmp_path, dtype):
    rows = make_rows()
    manifest = write(tiny_teacher, tmp_path, rows, dtype=dtype, layers=(-1, 1))
    assert [s["file"] for s in manifest["shards"]] == [shard_name(i) for i in range(3)]
    assert manifest["bytes_per_token"] == bytes_per_token(2, 32, K, dtype)
    dataset = CachedDataset(tmp_path)
    assert len(dataset) == N and torch.equal(dataset.input_ids, rows.input_ids)
    assert torch.equal(dataset.loss_mask, rows.loss_mask) and dataset.attention_mask.dtype == torch.long
    offline = OfflineTeacher(tmp_path, tiny_teacher, DATA_CFG, layers=(-1, 1))
    for start in range(0, N, 2):  # the writer's batches: float32 is then bit-exact
        idx = list(range(start, start + 2))
        batch = collate([dataset[i] for i in idx])
        online = tiny_teacher(rows.input_ids[idx], rows.attention_mask[idx], layers=(-1, 1))
        cached = offline.signals(batch, (-1, 1, 2))  # 2 is -1 by another name (2 layers)
        for i in (-1, 1):
            if dtype == "float32":
                assert torch.equal(cached.hidden[i], online.hidden[i])
            elif dtype == "fp8":  # e4m3: 3 mantissa bits, each token scaled to its own largest magnitude
                want = online.hidden[i]
                bound = want.abs() * 2**-4 + want.abs().amax(-1, keepdim=True) * 2**-12
                assert ((cached.hidden[i] - want).abs() <= bound).all() and not torch.equal(cached.hidden[i], want)
            else:
                torch.testing.assert_close(cached.hidden[i], online.hidden[i], rtol=1e-2, atol=1e-2)
        assert torch.equal(cached.hidden[2], cached.hidden[-1]) and cached.hidden[-1].dtype == torch.float32
        # softmax(dense cached logits) == the teacher renormalised on its top k, as topk_forward_kl sees it.
        top = online.logits_BTV.topk(K, dim=-1)
        expected = torch.zeros_like(online.logits_BTV).scatter(-1, top.indices, top.values.softmax(-1))
        assert cached.sparse and cached.logits_BTV is None  # training never sees a dense [B, T, V] expansion
        B, T = cached.shape_BT
        b, t = (x.reshape(-1) for x in torch.meshgrid(torch.arange(B), torch.arange(T), indexing="ij"))
        dense = cached.rows(b, t).view(B, T, -1)  # what a loss chunk expands, here for every row
        assert torch.isfinite(dense).all()
        torch.testing.assert_close(dense.softmax(-1), expected, rtol=0, atol=1e-6)


def run_training(teacher, dataset, run_dir, steps=10, drafter_cfg=MEDUSA):
    cfg = Config(trainer=TrainerConfig(engine="single", device="cpu", steps=steps, micro_batch_size=2, grad_accum=1,
                                       lr=1e-2, min_lr_ratio=0.1, warmup_steps=2, weight_decay=0.0, grad_clip=1.0,
                                       bf16=False, log_every=1, ckpt_every=100, keep_last=1, resume="never"),
                 drafter=drafter_cfg, target=TargetConfig(source="toy", name="tiny-llama"), seed=0,
                 logger=LoggerConfig(name="none"))
    torch.manual_seed(0)
    drafter = build_drafter(drafter_cfg, teacher)
    drafter.bind_target(teacher, initialize=True)
    logger = MetricsLogger(run_dir, cfg.logger, asdict(cfg))
    try:
        train(cfg, teacher, drafter, dataset, collate, functools.partial(topk_forward_kl, k=K),
              SingleEngine(cfg.trainer), run_dir, logger)
    finally:
        logger.close()
    return [json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fp8_costs_half_the_hidden_state_bytes_of_bfloat16_plus_a_scale_per_token():
    D, layers = 4096, 3
    hidden = {dtype: bytes_per_token(layers, D, K, dtype) - bytes_per_token(0, D, K, dtype) for dtype in STORE_DTYPES}
    assert hidden == {"float32": layers * D * 4, "bfloat16": layers * D * 2, "fp8": layers * (D + 4)}


@pytest.mark.parametrize("drafter_cfg,layers", [(MEDUSA, (-1,)), (EAGLE3, (0, 1, 2)), (DFLASH, (1,)),
                                                (PEAGLE, (0, 1, 2))], ids=["medusa", "eagle3", "dflash", "peagle"])
def test_offline_training_follows_the_online_loss_curve(tiny_teacher, tmp_path, drafter_cfg, layers):
    rows = make_rows()
    online = run_training(tiny_teacher, rows, tmp_path / "online", drafter_cfg=drafter_cfg)
    curves = {}
    for dtype in ("float32", "bfloat16"):
        write(tiny_teacher, tmp_path / dtype, rows, dtype=dtype, layers=layers)
        dataset, offline = open_teacher_cache(tmp_path / dtype, tiny_teacher, DATA_CFG, layers)
        curves[dtype] = run_training(offline, dataset, tmp_path / f"run-{dtype}", drafter_cfg=drafter_cfg)
    assert len(online) == 10 and online[-1] < online[0]
    torch.testing.assert_close(torch.tensor(curves["float32"]), torch.tensor(online), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(curves["bfloat16"]), torch.tensor(online), rtol=1e-3, atol=1e-5)
    gap = max(abs(a - b) / abs(b) for a, b in zip(curves["bfloat16"], online))
    print(f"max relative loss gap: float32 cache "
          f"{max(abs(a - b) / abs(b) for a, b in zip(curves['float32'], online)):.2e}, bfloat16 cache {gap:.2e}")


def tensors(path):
    return {f: load_file(str(path / f)) for f in sorted(os.listdir(path)) if f.startswith("shard-")}


def test_interrupted_write_resumes_to_the_same_cache(tiny_teacher, tmp_path):
    reference = write(tiny_teacher, tmp_path / "a")
    assert write(tiny_teacher, tmp_path / "b", max_shards=1) is None
    assert not (tmp_path / "b" / MANIFEST).exists() and (tmp_path / "b" / shard_name(0)).is_file()
    (tmp_path / "b" / f".{shard_name(1)}.tmp-99999").write_bytes(b"half a shard")  # killed mid-write
    resumed = write(tiny_teacher, tmp_path / "b")
    assert not list((tmp_path / "b").glob(".*"))  # the leftover temp file is gone
    assert [s["bytes"] for s in resumed["shards"]] == [s["bytes"] for s in reference["shards"]]
    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert a.keys() == b.keys()
    for f in a:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
        assert all(torch.equal(a[f][k], b[f][k]) for k in a[f])
    # A shard cut short after the fact is rewritten on rerun; the others are kept (not even rewritten).
    path = tmp_path / "b" / shard_name(1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    mtime = (tmp_path / "b" / shard_name(0)).stat().st_mtime_ns
    write(tiny_teacher, tmp_path / "b")
    assert (tmp_path / "b" / shard_name(0)).stat().st_mtime_ns == mtime
    assert path.read_bytes() == (tmp_path / "a" / shard_name(1)).read_bytes()


def test_wrong_target_or_data_names_the_component(tiny_teacher, tmp_path):
    write(tiny_teacher, tmp_path)
    other = Teacher(make_tiny_llama(seed=1, vocab_size=96), tokenizer=None, name="other-llama")
    with pytest.raises(ValueError, match=r"different target \(.*name: cached 'tiny-llama', now 'other-llama'.*"
                                         r"vocab_size.*python -m distill.cache"):
        OfflineTeacher(tmp_path, other, DATA_CFG, (-1,))
    with pytest.raises(ValueError, match=r"different data \(max_length: cached 16, now 32\).*python -m distill.cache"):
        open_teacher_cache(tmp_path, tiny_teacher, replace(DATA_CFG, max_length=32), (-1,))
    # Same name and sizes, other weights (e.g. a toy target rebuilt with other settings): still refused.
    retrained = Teacher(make_tiny_llama(seed=5), tokenizer=None, name="tiny-llama")
    with pytest.raises(ValueError, match=r"target_weights \(cached '[0-9a-f]+', now '[0-9a-f]+'\)"):
        OfflineTeacher(tmp_path, retrained, DATA_CFG, (-1,))
    # Where the cache lives is not part of what it holds.
    OfflineTeacher(tmp_path, tiny_teacher, replace(DATA_CFG, teacher_cache=str(tmp_path)), (-1,))
    # Writing another config into a finished cache's directory is refused, not mixed.
    with pytest.raises(ValueError, match=r"holds a finished cache for another config.*topk"):
        write(tiny_teacher, tmp_path, topk=8)


def test_truncated_shard_names_the_file(tiny_teacher, tmp_path):
    write(tiny_teacher, tmp_path)
    path = tmp_path / shard_name(1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{shard_name(1)} is truncated or corrupt.*delete it and rerun "
                                         r"`python -m distill.cache"):
        open_teacher_cache(tmp_path, tiny_teacher, DATA_CFG, (-1,))


def test_missing_layer_manifest_and_bad_topk(tiny_teacher, tmp_path):
    write(tiny_teacher, tmp_path)
    with pytest.raises(ValueError, match=r"layer \[1\].*holds only layers \[-1\].*cache.layers="):
        OfflineTeacher(tmp_path, tiny_teacher, DATA_CFG, (1,))
    with pytest.raises(FileNotFoundError, match=r"nowhere/manifest.json not found.*python -m distill.cache cache.dir="):
        CachedDataset(tmp_path / "nowhere")
    for k in (0, 129):
        with pytest.raises(ValueError, match=rf"cache.topk must be in 1..128 .*got {k}"):
            write(tiny_teacher, tmp_path / "k", topk=k)
    with pytest.raises(ValueError, match=r"loss.k=32 exceeds the teacher cache's top-16"):
        open_teacher_cache(tmp_path, tiny_teacher, DATA_CFG, (-1,),
                           {"_target_": "distill.losses.topk_forward_kl", "k": 32})
    with pytest.raises(ValueError, match=r"loss=rkl"):
        open_teacher_cache(tmp_path, tiny_teacher, DATA_CFG, (-1,), {"_target_": "distill.losses.reverse_kl"})


def test_cache_dir_is_required():
    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["target=tiny", "data.max_length=64"])
    assert cfg.cache.topk == 64 and cfg.cache.dtype == "bfloat16" and cfg.data.teacher_cache is None
    with pytest.raises(ValueError, match=r"cache.dir is null; set cache.dir="):
        build_cache(load_config(cfg))


@pytest.fixture(scope="module")
def cli_cache(tmp_path_factory, tiny_toy_target):
    """``python -m distill.cache`` once on the tiny target (the session's, in its SPECDRAFT_CACHE)."""
    root = tmp_path_factory.mktemp("cli")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    overrides = ["target=tiny", "data.max_length=64", "data.corpus_max_bytes=30000", "cache.shard_rows=16",
                 "cache.topk=8", "trainer.device=cpu"]
    proc = subprocess.run([sys.executable, "-m", "distill.cache", *overrides, f"cache.dir={root / 'cache'}",
                           f"hydra.run.dir={root / 'hydra'}"], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root, overrides, proc.stdout


def test_cli_writes_a_cache_and_prints_its_size(cli_cache):
    root, _, stdout = cli_cache
    manifest = json.loads((root / "cache" / MANIFEST).read_text())
    assert manifest["layers"] == [-1] and manifest["topk"] == 8 and manifest["max_length"] == 64  # Medusa's layers
    assert manifest["bytes_per_token"] == bytes_per_token(1, 64, 8, "bfloat16") == 64 * 2 + 8 * 8 + 6
    assert re.search(rf"{manifest['bytes_per_token']} bytes/token, expected [0-9.]+ MiB in ", stdout)
    assert len(CachedDataset(root / "cache")) == manifest["num_rows"] > 0


def test_train_run_switches_to_the_cache(cli_cache, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs
    from train.run import run_training as run

    root, overrides, _ = cli_cache
    monkeypatch.setattr("train.run.build_train_dataset", lambda *a: pytest.fail("rebuilt the rows online"))
    register_configs()
    common = [*overrides, f"data.teacher_cache={root / 'cache'}", "trainer.steps=3", "trainer.micro_batch_size=2",
              "trainer.log_every=1", "trainer.bf16=false", "eval.enabled=false", "loss=topk_fkl", "loss.k=8"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=common)
        bad = compose(config_name="config", overrides=[*common, "data.max_length=32"])
    run(load_config(cfg), tmp_path / "run")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 2 and (tmp_path / "run" / "drafter" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match=r"different data \(max_length: cached 64, now 32\)"):
        run(load_config(bad), tmp_path / "bad")
