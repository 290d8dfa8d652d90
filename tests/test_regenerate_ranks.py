"""Regeneration across ranks (distill.regenerate.ranks): 2 ranks on gloo write the same bytes as 1 process, and a
rank killed with SIGKILL mid-run is resumed by rerunning the command to the same bytes."""

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from distill.lock import lock_file_for
from distill.regenerate import batch_plan, meta_path
from distill.regenerate.ranks import shard_dir, shard_path
from tests import torchrun
from tests.torchrun import ROOT


def test_batches_go_round_robin_and_keep_their_prompts():
    single = batch_plan(7, 2)
    assert [list(b) for b in single] == [[0, 1], [2, 3], [4, 5], [6]]
    shares = [batch_plan(7, 2, rank, 3) for rank in range(3)]
    assert [[list(b) for b in s] for s in shares] == [[[0, 1], [6]], [[2, 3]], [[4, 5]]]
    assert batch_plan(3, 4, 1, 2) == []  # a rank with no batch still takes part


def command(out: Path, tmp: Path, ranks: int, num_prompts: int, max_new: int) -> list[str]:
    return torchrun.command("distill.regenerate", [
        "target=tiny", "trainer.device=cpu", "data.max_length=64", "data.corpus_max_bytes=20000",
        "regenerate.prompt_tokens=12", f"regenerate.num_prompts={num_prompts}", "regenerate.batch_size=2",
        "regenerate.temperature=1.0", f"regenerate.max_new_tokens={max_new}", f"regenerate.out={out}",
        f"hydra.run.dir={tmp / 'hydra'}"], ranks)


@pytest.fixture
def reference(tmp_path, tiny_toy_target):
    """One process's file: 7 prompts in batches of 2 (the last one short), sampled, so every batch's seed matters."""
    out = tmp_path / "one" / "regen.jsonl"
    torchrun.run(command(out, tmp_path / "one", 1, 7, 8))
    return out


# Slow: the killed-rank test below also compares two ranks' bytes with one process's.
@pytest.mark.slow
def test_two_ranks_write_the_bytes_one_process_writes(tmp_path, reference):
    out = tmp_path / "two" / "regen.jsonl"
    torchrun.run(command(out, tmp_path / "two", 2, 7, 8))
    assert out.read_bytes() == reference.read_bytes()
    assert meta_path(out).read_bytes() == meta_path(reference).read_bytes()
    assert not shard_dir(out).exists()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == list(range(7))
    torchrun.run(command(out, tmp_path / "two", 2, 7, 8))  # a rerun of a finished file changes nothing
    assert out.read_bytes() == reference.read_bytes()


def test_a_rank_killed_mid_run_resumes_to_the_same_bytes(tmp_path, tiny_toy_target):
    num_prompts, max_new = 40, 48
    reference = tmp_path / "one" / "regen.jsonl"
    torchrun.run(command(reference, tmp_path / "one", 1, num_prompts, max_new))

    out = tmp_path / "two" / "regen.jsonl"
    launcher = torchrun.start(command(out, tmp_path / "two", 2, num_prompts, max_new))
    shard, lock = shard_path(out, 1, 2), lock_file_for(shard_path(out, 1, 2))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and launcher.poll() is None:  # rank 1 has written a batch or more
        if shard.is_file() and shard.read_bytes().count(b"\n") >= 2 and lock.is_file() and lock.read_text():
            break
        time.sleep(0.02)
    assert launcher.poll() is None, "the 2-rank run ended before a rank could be killed: " + launcher.stderr.read()[-3000:]
    os.kill(json.loads(lock.read_text())["pid"], signal.SIGKILL)
    launcher.communicate(timeout=300)
    assert launcher.returncode != 0 and not out.exists()
    written = shard.read_bytes().count(b"\n")
    assert 2 <= written < num_prompts // 2  # killed part way through its share

    torchrun.run(command(out, tmp_path / "two", 2, num_prompts, max_new))
    assert out.read_bytes() == reference.read_bytes()


def test_train_regenerates_first_then_reuses_the_answers(tmp_path, tiny_toy_target):
    """``data.mode=regenerate``: ``python -m train`` writes the answers itself (no file named), keyed by target, data
    and settings, and a second run with the same three trains on the same file without regenerating."""
    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs
    from train.run import run_training

    register_configs()
    overrides = ["experiment=eagle1_regen_top1", "target=tiny", "data.max_length=64", "data.corpus_max_bytes=20000",
                 "regenerate.num_prompts=6", "regenerate.batch_size=3", "regenerate.prompt_tokens=12",
                 "regenerate.max_new_tokens=16", "trainer.steps=2", "trainer.micro_batch_size=2", "trainer.device=cpu",
                 "trainer.eval_every=2", "trainer.eval_rows=2", "eval.enabled=false", f"target.cache_dir={tmp_path / 'c'}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    assert cfg.data.mode == "regenerate" and cfg.data.regenerated is None
    # The session's tiny target, copied into this run's own cache (whose regenerated/ the test inspects): the runs
    # load it instead of building it again, as a user's second run would.
    for built in Path(os.environ["SPECDRAFT_CACHE"]).glob("toy-*"):
        shutil.copytree(built, tmp_path / "c" / built.name)
    run_training(cfg, tmp_path / "run1")
    files = sorted((tmp_path / "c" / "regenerated").glob("*.jsonl"))
    assert len(files) == 1 and len(files[0].read_text().splitlines()) == 6
    before = files[0].stat().st_mtime_ns
    run_training(cfg, tmp_path / "run2")
    assert sorted((tmp_path / "c" / "regenerated").glob("*.jsonl")) == files
    assert files[0].stat().st_mtime_ns == before


@pytest.mark.slow
def test_two_rank_training_regenerates_one_process_bytes_then_trains_on_them(tmp_path, tiny_toy_target):
    """``data.mode=regenerate`` in a 2-rank ``python -m train``: the run's own ranks share the prompts, the file is
    the one ``python -m distill.regenerate`` writes in one process, and the training rows are that file's."""
    from hydra import compose, initialize_config_dir

    from distill.data import rows_fingerprint
    from distill.regenerate import load_regenerated
    from train.checkpoint import STATE
    from train.config import load_config, register_configs

    settings = ["target=tiny", "trainer.device=cpu", "data.max_length=64", "data.corpus_max_bytes=20000",
                "regenerate.prompt_tokens=12", "regenerate.num_prompts=7", "regenerate.batch_size=2",
                "regenerate.temperature=1.0", "regenerate.max_new_tokens=16"]
    one, two, run_dir = tmp_path / "one" / "regen.jsonl", tmp_path / "two" / "regen.jsonl", tmp_path / "run"
    torchrun.run(torchrun.command("distill.regenerate", [*settings, f"regenerate.out={one}",
                                                         f"hydra.run.dir={tmp_path / 'one' / 'hydra'}"], 1))
    training = [*settings, "experiment=eagle1_regen_top1", "trainer=ddp", f"data.regenerated={two}",
                "trainer.steps=2", "trainer.micro_batch_size=2", "trainer.select=last", "trainer.eval_every=0",
                "eval.enabled=false"]
    torchrun.run(torchrun.command("train", [*training, f"hydra.run.dir={run_dir}"], 2))
    assert two.read_bytes() == one.read_bytes() and len(one.read_text().splitlines()) == 7
    assert meta_path(two).read_bytes() == meta_path(one).read_bytes()
    assert not shard_dir(two).exists()

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=training))
    rows = load_regenerated(one, tiny_toy_target[1], cfg.data)
    state = torch.load(run_dir / "checkpoints" / "step_0000002" / STATE, weights_only=True)
    assert state["world_size"] == 2
    assert (state["data"]["num_examples"], state["data"]["rows_digest"]) == (len(rows), rows_fingerprint(rows))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hf_generate_engine_answers_like_the_batched_decoder_at_t0_and_by_seed(tmp_path, monkeypatch, temperature):
    """``regenerate.engine=hf``: greedy answers equal the batched decoder's on the tiny target (no near-ties there);
    sampled ones are reproducible from the seed (the same file twice) and change with it."""
    from distill.regenerate.__main__ import regenerate
    from tests.test_regenerate import _words, compose, make_teacher, make_tokenizer, text_data

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_words(random.Random(0), 300))
    teacher = make_teacher(make_tokenizer())
    monkeypatch.setattr("distill.regenerate.__main__.load_teacher",
                        lambda target_cfg, device="cpu", placement="none": teacher)

    def answers(name, engine, seed=0):
        out = tmp_path / f"{name}.jsonl"
        regenerate(compose(text_data(corpus), out, engine=engine, temperature=temperature, seed=seed))
        return [(r["id"], r["completion_ids"], r["finish"]) for r in map(json.loads, out.read_text().splitlines())]

    hf = answers("hf", "hf")
    assert len(hf) == 7 and all(len(c) > 0 for _, c, _ in hf)
    if temperature == 0:
        assert hf == answers("batched", "batched")
    else:
        assert hf == answers("hf_again", "hf") != answers("hf_seed1", "hf", seed=1)


def test_progress_lines_give_tokens_per_second_and_an_eta(caplog):
    from distill.progress import Progress

    now = [0.0]
    progress = Progress("regenerate", 100, "prompts", every_s=10.0, clock=lambda: now[0])
    with caplog.at_level("INFO", logger="distill.progress"):
        now[0] = 5.0
        progress.update(10, 500)  # under every_s since the start: no line yet
        now[0] = 20.0
        progress.update(30, 1500)
        now[0] = 50.0
        progress.update(60, 3000)  # done: always a line
    assert [r.getMessage() for r in caplog.records] == [
        "regenerate: 40/100 prompts (40.0%), 100 tokens/s, ETA 0m30s",
        "regenerate: 100/100 prompts (100.0%), 100 tokens/s, ETA 0m00s"]
