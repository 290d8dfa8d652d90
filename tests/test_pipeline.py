"""End to end, as a user runs it: `python -m train experiment=smoke`, then `python -m eval drafter_path=...`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT_KEYS = {"drafter", "num_prompts", "new_tokens", "tau", "alpha", "alpha_per_position", "tokens_per_s",
               "greedy_tokens_per_s", "speedup", "identical_to_greedy"}


@pytest.fixture(scope="module")
def env(tiny_toy_target):
    """The session's environment (its own SPECDRAFT_CACHE, offline; conftest), where the tiny target is built."""
    e = dict(os.environ)
    e.pop("CUDA_VISIBLE_DEVICES", None)
    return e


def run_module(module, args, env, check=True):
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"python -m {module} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("smoke")
    run_module("train", ["experiment=smoke", f"hydra.run.dir={run_dir}"], env)
    return run_dir


def test_smoke_train_writes_drafter_metrics_and_report(smoke_run):
    report = json.loads((smoke_run / "report.json").read_text())
    names = [r["drafter"] for r in report["results"]]
    assert names == ["eagle1", "lookup"]  # the default drafter, then the baseline
    for r in report["results"]:
        assert RESULT_KEYS <= r.keys()
        assert r["identical_to_greedy"] is True
        assert r["num_prompts"] == 3 and r["new_tokens"] > 0
        assert r["tau"] >= 1.0 and 0.0 <= r["alpha"] <= 1.0
    assert (smoke_run / "drafter" / "model.safetensors").is_file()
    assert json.loads((smoke_run / "drafter" / "config.json").read_text())["drafter"]["variant"] == "eagle1"
    lines = (smoke_run / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["step"] == 29 and "train/acc_head1" in last and last["train/sim_tau"] >= 1.0
    assert (smoke_run / "summary.txt").is_file()


def test_eval_reloads_the_saved_drafter(smoke_run, env, tmp_path):
    run_module("eval", [f"drafter_path={smoke_run / 'drafter'}", "experiment=smoke", f"hydra.run.dir={tmp_path}"], env)
    report = json.loads((tmp_path / "report.json").read_text())
    trained = json.loads((smoke_run / "report.json").read_text())
    eagle = next(r for r in report["results"] if r["drafter"] == "eagle1")
    assert eagle["identical_to_greedy"] is True
    # Greedy decoding is deterministic: the reloaded drafter accepts exactly the same tokens.
    assert eagle["accept_counts"] == trained["results"][0]["accept_counts"]
    assert eagle["sim_tau"] >= 1.0  # the training-time estimate travels with the saved drafter


def test_missing_data_file_is_a_clear_error(smoke_run, env, tmp_path):
    proc = run_module("train", ["experiment=smoke", "data.source=file", "data.path=/no/such/file.jsonl",
                                f"hydra.run.dir={tmp_path}"], env, check=False)
    assert proc.returncode != 0
    assert "/no/such/file.jsonl" in proc.stderr and "data.path" in proc.stderr


@pytest.mark.slow  # tests/test_config.py refuses trainer.lrr in-process; a CLI error's exit and stderr: the test above
def test_unknown_key_is_a_clear_error(env, tmp_path):
    proc = run_module("train", ["experiment=smoke", "trainer.lrr=1", f"hydra.run.dir={tmp_path}"], env, check=False)
    assert proc.returncode != 0 and "lrr" in proc.stderr


# Slow: the smoke run above is the fast end-to-end pipeline; the parts are fast elsewhere: the regenerate CLI
# (test_regenerate.py::test_cli_writes_answers_of_the_configured_target), training on regenerated answers
# (test_regenerate_ranks.py::test_train_regenerates_first_then_reuses_the_answers), mixed / on-policy batches and the
# refusal of a drafter that cannot sample (test_onpolicy.py), the draft model trained and decoded (test_families.py).
@pytest.mark.slow
def test_draft_model_on_regenerated_and_mixed_data(env, tmp_path):
    """DistillSpec end to end: the target answers the data's prompts, then a draft model built from the target's config
    trains on those answers with half its micro-batches written by the draft itself, and decodes losslessly."""
    regen = tmp_path / "regen.jsonl"
    run_module("distill.regenerate", ["experiment=smoke", f"regenerate.out={regen}", "regenerate.num_prompts=16",
                                      "regenerate.temperature=1.0", f"hydra.run.dir={tmp_path / 'r'}"], env)
    assert len(regen.read_text().splitlines()) == 16
    run_dir = tmp_path / "train"
    run_module("train", ["experiment=smoke", "drafter=draft_model", "loss=jsd", "data.mode=mixed",
                         f"data.regenerated={regen}", "trainer.steps=6", "trainer.micro_batch_size=2",
                         "eval.hf_baselines=false", "eval.num_prompts=2", f"hydra.run.dir={run_dir}"], env)
    saved = json.loads((run_dir / "drafter" / "config.json").read_text())
    assert saved["training"]["data"]["mode"] == "mixed" and saved["drafter"]["model_config"]["num_hidden_layers"] == 1
    draft = next(r for r in json.loads((run_dir / "report.json").read_text())["results"] if r["drafter"] == "draft_model")
    assert draft["identical_to_greedy"] is True and draft["tau"] >= 1.0
    proc = run_module("train", ["experiment=smoke", "drafter=medusa", "data.mode=on_policy",
                                f"hydra.run.dir={tmp_path / 'bad'}"], env, check=False)
    assert proc.returncode != 0 and "drafter=medusa cannot" in proc.stderr


# Slow: every kind's export to every engine is checked byte for byte by test_export_digests.py; this
# repeats it after a smoke run.
@pytest.mark.slow
def test_smoke_eagle1_exports_for_every_engine(smoke_run, env, tmp_path, monkeypatch):
    """The README's export command on a trained run: each EAGLE-1 layout passes its engine's loader mapping, and the
    card's serve command names the toy target's local directory (a name vLLM / SGLang can resolve)."""
    proc = subprocess.run([sys.executable, "scripts/export.py", f"drafter_path={smoke_run / 'drafter'}",
                           "format=vllm", f"output_dir={tmp_path / 'vllm'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from serve.export import export_drafter

    monkeypatch.setenv("SPECDRAFT_CACHE", env["SPECDRAFT_CACHE"])  # the toy target's cache, as the CLI saw it
    for engine in ("sglang", "hf"):  # the same function the CLI calls, without another interpreter start
        export_drafter(smoke_run / "drafter", engine, tmp_path / engine)
    with pytest.raises(ValueError, match="no EAGLE-1 model class"):
        export_drafter(smoke_run / "drafter", "speculators", tmp_path / "spec")
    for engine in ("vllm", "sglang", "hf"):
        card = (tmp_path / engine / "README.md").read_text()
        serve = card.split("```bash\n", 1)[1].split("```", 1)[0]
        assert env["SPECDRAFT_CACHE"] in serve and "specdraft/tiny-stdlib" not in serve


@pytest.mark.parametrize("kind", [pytest.param("eagle3", marks=pytest.mark.slow),
                                  pytest.param("medusa", marks=pytest.mark.slow),
                                  pytest.param("medusa2", marks=pytest.mark.slow),
                                  pytest.param("draft_model", marks=pytest.mark.slow),
                                  pytest.param("lookup", marks=pytest.mark.slow)])
def test_smoke_runs_for_every_drafter_kind(kind, env, tmp_path):
    """`python -m train experiment=smoke drafter=<kind>`, as the README documents it (eagle1 is the smoke_run above;
    eagle3's 3,072-token draft vocabulary preset exceeds the tiny target's 512 and falls back to the full one)."""
    run_module("train", ["experiment=smoke", f"drafter={kind}", f"hydra.run.dir={tmp_path}"], env)
    report = json.loads((tmp_path / "report.json").read_text())
    row = next(r for r in report["results"] if r["drafter"] == kind)
    assert row["identical_to_greedy"] is True and row["tau"] >= 1.0
