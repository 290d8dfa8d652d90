"""scripts/bench_recipe.py end to end on the tiny preset: train, decode every tree budget, resume without retraining."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_recipe.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_recipe", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
def test_bench_recipe_tiny_rows_are_lossless_and_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    bench = _load()
    out = tmp_path / "recipe.json"
    argv = ["--preset", "tiny", "--out", str(out), "--work", str(tmp_path / "work"), "--seeds", "0",
            "--rows", "eagle1", "eagle1_ttt2"]
    bench.main(argv)
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"eagle1/s0", "eagle1_ttt2/s0"}
    for row in rows.values():
        assert set(row["trees"]) == set(bench.TREES)
        for tree in row["trees"].values():
            assert tree["identical_to_greedy"] and tree["tau"] >= 1 and tree["target_forwards"] > 0
        assert row["cpu_s"] > 0 and row["final"]["train/acc_head1"] >= 0
    assert "train/acc_head2" in rows["eagle1_ttt2/s0"]["final"]  # the TTT override reached the drafter

    def no_training(*args, **kwargs):
        raise AssertionError("a row already in --out was trained again")

    monkeypatch.setattr(bench, "train_row", no_training)
    bench.main(argv)
    assert "eagle1/s0: done already" in capsys.readouterr().out
    bench.main([*argv[:4], "--table"])
    assert "| eagle1_ttt2 | 0 |" in capsys.readouterr().out


@pytest.mark.slow  # a check of the recipe bench's rows, not of training
def test_every_row_composes_into_a_valid_config():
    """A row whose override is misspelt (or names a key its drafter / loss lacks) fails here, not after minutes of
    training; a row must also change something, or it measures the baseline twice."""
    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs

    bench = _load()
    register_configs()
    conf = str(SCRIPT.parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        base = load_config(compose(config_name="config", overrides=["drafter=eagle1"]))
        for name, (overrides, steps) in bench.ROWS.items():
            cfg = load_config(compose(config_name="config", overrides=[*overrides, *bench.TRAIN, f"trainer.steps={steps}"]))
            assert cfg.trainer.steps == steps > 0, name
            if name != "eagle1" and steps == 350:
                assert (cfg.drafter, cfg.loss, cfg.data, cfg.trainer.lr) != (base.drafter, base.loss, base.data,
                                                                            base.trainer.lr), name


@pytest.mark.parametrize("experiment,row,regenerates", [
    ("eagle1_regen_top1", "eagle1_regen0_top1ce_kl1", True),
    ("eagle3_regen_top1", "eagle3_ttt3_regen0_top1ce_kl1_decay1_vocab1024_warmup300_10cpumin", False),
])
def test_experiment_preset_is_the_winning_recipe_row_and_asks_for_its_data(tmp_path, experiment, row, regenerates):
    """conf/experiment/<experiment>.yaml composes to the overrides of bench_recipe's winning row for its drafter
    kind; a preset that regenerates its data itself (data.mode=regenerate) needs no file, the other one refuses to
    start without data.regenerated, naming the key."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from train.config import load_config, register_configs

    register_configs()
    conf = str(SCRIPT.parents[1] / "conf")
    row = _load().ROWS[row][0]
    regen = str(tmp_path / "regen.jsonl")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        preset = compose(config_name="config", overrides=[f"experiment={experiment}", f"data.regenerated={regen}"])
        by_hand = compose(config_name="config", overrides=[o if not o.startswith("data.regenerated=") else
                                                           f"data.regenerated={regen}" for o in row])
        missing = compose(config_name="config", overrides=[f"experiment={experiment}"])
    for node in ("loss", "drafter") if regenerates else ("data", "loss", "drafter"):
        assert OmegaConf.to_container(preset[node]) == OmegaConf.to_container(by_hand[node])
    if regenerates:  # the row's file was written at T = 0: the preset regenerates greedily itself
        assert load_config(missing).data.mode == "regenerate" and preset.regenerate.temperature == 0
        return
    with pytest.raises(Exception, match="data.regenerated"):
        load_config(missing)


def test_the_losses_group_changes_only_the_loss_against_its_forward_kl_row():
    """``--group losses``: EAGLE-3 at equal steps, each row the forward-KL row with another ``loss=`` (a row that
    changed more would not measure the objective alone)."""
    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs

    bench = _load()
    assert all(row in bench.ROWS for rows in bench.GROUPS.values() for row in rows)
    register_configs()
    with initialize_config_dir(config_dir=str(SCRIPT.parents[1] / "conf"), version_base="1.3"):
        cfgs = {row: load_config(compose(config_name="config", overrides=[*bench.ROWS[row][0], *bench.TRAIN]))
                for row in bench.GROUPS["losses"]}
    base = cfgs.pop("eagle3_fkl_600")
    assert base.loss["_target_"] == "distill.losses.forward_kl" and base.drafter["variant"] == "eagle3"
    assert len({cfg.loss["_target_"] + str(cfg.loss.get("variant")) for cfg in cfgs.values()}) == len(cfgs)
    for row, cfg in cfgs.items():
        assert bench.ROWS[row][1] == bench.ROWS["eagle3_fkl_600"][1] == 600
        assert (cfg.drafter, cfg.data, cfg.trainer) == (base.drafter, base.data, base.trainer), row
        assert cfg.loss != base.loss, row
