"""Nothing lost: the data-loss cases on a real run dir, each comparing its contents before and after.

One smoke-sized run (the session's tiny toy target, Medusa, 4 steps, a checkpoint every 2) trains in-process; each
test copies it and does what a careless user would. ``snapshot`` keeps every file's bytes *and* modification time,
so "unchanged" means not rewritten at all, not merely rewritten with the same bytes (a deterministic rerun would do
that).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from train import checkpoint
from train.config import EvalConfig, load_config, register_configs
from train.run import run_training

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


def compose_cfg(cache_dir, *overrides, drafter=("drafter=medusa", "drafter.num_heads=2")):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return load_config(compose(config_name="config", overrides=[
            "experiment=smoke", *drafter, f"target.cache_dir={cache_dir}",
            "data.corpus_max_bytes=60000", "trainer.steps=4", "trainer.ckpt_every=2", "trainer.log_every=1",
            "trainer.micro_batch_size=2", "trainer.device=cpu", "eval.enabled=false", *overrides]))


def snapshot(run_dir: Path) -> dict[str, tuple[str, int]]:
    return {p.relative_to(run_dir).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cache(tiny_toy_target):
    """The session's toy-target cache, the tiny target already built there."""
    return Path(os.environ["SPECDRAFT_CACHE"])


EAGLE = ("drafter=eagle1",)  # random initial weights: a build that moved the seed would show in its loss curve
# The first run's target: the tiny one on a pretraining budget a tenth of its own (the build is what is tested here,
# not what it yields), kept apart from the session's target in a cache of its own.
SMALL_TOY = ("target.toy.steps=15", "target.toy.warmup_steps=3", "target.toy.corpus_max_bytes=100000")


@pytest.fixture(scope="module")
def first_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("toy-cache")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, first_cache):
    """The first run on this "machine": its target is not cached yet, so this run builds it."""
    assert not any(first_cache.iterdir())
    run_dir = tmp_path_factory.mktemp("first")
    run_training(compose_cfg(first_cache, *SMALL_TOY, drafter=EAGLE), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("finished")
    run_training(compose_cfg(cache), run_dir)
    return run_dir


@pytest.fixture
def run_dir(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def test_finished_run_records_what_later_checks_need(finished):
    saved = json.loads((finished / "drafter" / "config.json").read_text())
    assert len(saved["target"]["weights_digest"]) == 16  # checked again at evaluation
    assert saved["training"]["final"]["train/loss"] > 0 and saved["training"]["eval"]["prompt_tokens"] == 48
    assert steps_logged(finished) == [0, 1, 2, 3]
    assert [p.name for p in checkpoint.complete_checkpoints(finished)] == ["step_0000002", "step_0000004"]


def test_export_overwrite_never_touches_the_run_dir(run_dir):
    from serve.export import export_drafter

    before = snapshot(run_dir)
    for out in (run_dir, run_dir / "drafter", run_dir / "exports" / "vllm", run_dir.parent,
                run_dir / "checkpoints"):
        with pytest.raises(ValueError, match="run dir"):
            export_drafter(run_dir / "drafter", "vllm", out, overwrite=True)
    with pytest.raises(ValueError, match="run dir"):  # a checkpoint's drafter belongs to the same run
        export_drafter(run_dir / "checkpoints" / "step_0000002" / "drafter", "vllm", run_dir, overwrite=True)
    assert snapshot(run_dir) == before
    out = export_drafter(run_dir / "drafter", "vllm", run_dir.parent / "export", overwrite=True)  # outside: fine
    assert (out / "config.json").is_file() and snapshot(run_dir) == before


def test_missing_latest_resumes_from_the_newest_complete_checkpoint(run_dir, cache):
    (run_dir / "checkpoints" / "latest").unlink()
    before = snapshot(run_dir)
    run_training(compose_cfg(cache), run_dir)  # finished at step 4: nothing to train, nothing rewritten
    assert snapshot(run_dir) == before
    run_training(compose_cfg(cache, "trainer.steps=6"), run_dir)  # extends from step 4, not from 0
    assert steps_logged(run_dir) == [0, 1, 2, 3, 4, 5]
    assert before["checkpoints/step_0000004/trainer_state.pt"] == snapshot(run_dir)[
        "checkpoints/step_0000004/trainer_state.pt"]


def test_dangling_or_garbage_latest_is_refused_with_advice_that_keeps_the_checkpoints(run_dir, cache):
    latest = run_dir / "checkpoints" / "latest"
    for content, match in ((b"step_0000009", "incomplete or missing"), (b"\xff\x00../../etc", "not a checkpoint name")):
        latest.write_bytes(content)
        before = snapshot(run_dir)
        with pytest.raises((ValueError, FileNotFoundError), match=match) as err:
            run_training(compose_cfg(cache), run_dir)
        assert "delete" in str(err.value) and "step_0000004" in str(err.value)  # the advice resumes, never restarts
        assert snapshot(run_dir) == before


def test_resume_never_into_a_used_run_dir_is_refused(run_dir, cache):
    before = snapshot(run_dir)
    with pytest.raises(FileExistsError, match="fresh hydra.run.dir"):
        run_training(compose_cfg(cache, "trainer.resume=never"), run_dir)
    assert snapshot(run_dir) == before


def test_fresh_start_over_a_finished_run_without_checkpoints_is_refused(run_dir, cache):
    shutil.rmtree(run_dir / "checkpoints")
    before = snapshot(run_dir)
    with pytest.raises(FileExistsError, match="no checkpoint to resume from"):
        run_training(compose_cfg(cache), run_dir)
    assert snapshot(run_dir) == before


def test_keep_last_never_prunes_the_checkpoint_just_written(tmp_path):
    root = checkpoint.checkpoint_root(tmp_path)
    for step in (10, 1):  # an earlier run's later checkpoint, then this one's
        (root / f"step_{step:07d}").mkdir(parents=True)
        (root / f"step_{step:07d}" / checkpoint.STATE).write_bytes(b"x")
    checkpoint._prune(root, 1, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000001", "step_0000010"]
    (root / "step_0000003").mkdir()
    (root / "step_0000003" / checkpoint.STATE).write_bytes(b"x")
    checkpoint._prune(root, 3, keep_last=1)  # older ones of this run do go
    assert sorted(p.name for p in root.iterdir()) == ["step_0000003", "step_0000010"]


def test_rerunning_a_finished_run_changes_nothing_and_keeps_its_final_metrics(run_dir, cache):
    before = snapshot(run_dir)
    run_training(compose_cfg(cache), run_dir)
    assert snapshot(run_dir) == before
    assert json.loads((run_dir / "drafter" / "config.json").read_text())["training"]["final"]


def test_rerunning_with_fewer_steps_is_refused(run_dir, cache):
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=r"past trainer.steps=2.*trainer.steps>=4"):
        run_training(compose_cfg(cache, "trainer.steps=2"), run_dir)
    assert snapshot(run_dir) == before


def test_metrics_hold_each_step_once_after_a_resume(run_dir, cache):
    # As if killed after logging step 3 but before writing step_0000004: the resume replays steps 2 and 3.
    shutil.rmtree(run_dir / "checkpoints" / "step_0000004")
    shutil.rmtree(run_dir / "drafter")
    (run_dir / "checkpoints" / "latest").write_text("step_0000002")
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    run_training(compose_cfg(cache), run_dir)
    after = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert steps_logged(run_dir) == [0, 1, 2, 3]
    assert after[:2] == before[:2]  # rows before the checkpoint are kept as they were


def test_first_run_on_a_machine_trains_like_every_later_one(first_run, first_cache, tmp_path):
    """``first_run`` built its target into the empty cache; this run loads it: the same loss curve."""
    run_training(compose_cfg(first_cache, *SMALL_TOY, drafter=EAGLE), tmp_path)
    losses = [[json.loads(x)["train/loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (first_run, tmp_path)]
    assert losses[0] == losses[1]


def test_diverged_training_stops_and_saves_nothing_non_finite(tmp_path, cache):
    from safetensors.torch import load_file
    import torch

    with pytest.raises(FloatingPointError, match=r"step \d+: train/(loss|grad_norm) is (nan|inf)") as err:
        run_training(compose_cfg(cache, "trainer.lr=1e30", "trainer.ckpt_every=1", "trainer.warmup_steps=0"), tmp_path)
    assert "fresh hydra.run.dir" in str(err.value)
    assert not (tmp_path / "drafter").exists()
    for ckpt in checkpoint.complete_checkpoints(tmp_path):
        assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / "drafter" / "model.safetensors")).values())


def test_rows_cut_before_their_loss_tokens_advise_raising_max_length(tmp_path, cache):
    from distill.data import DataConfig, build_train_dataset
    from distill.toy import load_or_build_toy_target

    cfg = compose_cfg(cache)
    _, tokenizer = load_or_build_toy_target(asdict(cfg.target.toy), cache_dir=cache)
    data = tmp_path / "chat.jsonl"
    long_question = "explain " * 80
    data.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": long_question},
                                                           {"from": "gpt", "value": "ok"}]}) for _ in range(4)))
    with pytest.raises(ValueError, match="raise data.max_length"):
        build_train_dataset(DataConfig(source="file", path=str(data), max_length=32, packing=False,
                                       chat_template="none"), tokenizer)


def eval_overrides(drafter_path, *extra):
    return [f"drafter_path={drafter_path}", "eval.num_prompts=1", "eval.hf_baselines=false", "eval.plots=false",
            "eval.warmup_prompts=0", "eval.baselines=[]", "trainer.device=cpu", *extra]


def run_eval_cli(overrides, out_dir):
    from eval.run import run_eval

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return run_eval(cfg, out_dir, overrides=overrides)


def test_eval_of_a_smoke_drafter_reuses_the_runs_settings_or_fits_the_target(run_dir, tmp_path):
    """The README's "re-evaluate a saved drafter" on a smoke run, with no experiment=smoke: the default prompt (128)
    + new tokens (96) would not fit the tiny target's 128 positions."""
    report = run_eval_cli(eval_overrides(run_dir / "drafter"), tmp_path / "a")
    assert report["max_new_tokens"] == 32  # the run's own eval.max_new_tokens (experiment=smoke)
    config = run_dir / "drafter" / "config.json"
    saved = json.loads(config.read_text())
    del saved["training"]["eval"]  # a drafter saved without its run's settings: the defaults are fitted
    config.write_text(json.dumps(saved))
    report = run_eval_cli(eval_overrides(run_dir / "drafter"), tmp_path / "b")
    assert 32 < report["max_new_tokens"] < 96 and report["results"][0]["new_tokens"] > 0


def test_eval_prompts_file_is_cut_by_prompt_tokens(run_dir, cache, tmp_path):
    from distill.toy import load_or_build_toy_target
    from eval.run import eval_prompts

    _, tokenizer = load_or_build_toy_target(asdict(compose_cfg(cache).target.toy), cache_dir=cache)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n    return x\n" * 40, "category": "code"}) + "\n")
    ids, _ = eval_prompts(EvalConfig(prompts=str(prompts), num_prompts=1, prompt_tokens=24), tokenizer)
    assert len(ids[0]) == 24
    report = run_eval_cli(eval_overrides(run_dir / "drafter", f"eval.prompts={prompts}"), tmp_path / "e")
    assert report["results"][0]["new_tokens"] > 0  # 48 prompt tokens + 32 new fit; uncut it would not


def test_eval_applies_decode_time_drafter_keys_to_a_saved_drafter(first_run, tmp_path):
    """EAGLE's dynamic tree keeps 16 nodes by default; drafter.total_tokens=30 must measure a 30-node tree."""
    overrides = eval_overrides(first_run / "drafter", "drafter.total_tokens=30", "drafter.top_k=6")
    report = run_eval_cli(overrides, tmp_path)
    assert report["results"][0]["drafter"] == "eagle1" and report["results"][0]["tree_size"] == 30
    with pytest.raises(ValueError, match="drafter.ttt_steps=3 cannot apply"):
        run_eval_cli(eval_overrides(first_run / "drafter", "drafter.ttt_steps=3"), tmp_path / "x")
