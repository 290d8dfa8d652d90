"""Shared fixtures: a tiny real Llama built in-process (no hub), wrapped as a frozen teacher; the tiny stdlib toy
target (``conf/target/tiny.yaml``), built once per session; and a session that writes nothing under the user's home.

Every test session gets its own ``SPECDRAFT_CACHE`` (toy targets, the checkpoint signing key) and its own cache and
config dirs for the libraries that would otherwise write under ``~`` (matplotlib, Triton, wandb, the HF and torch
hubs), and no network; subprocesses started by tests inherit all of it. Set at the top of this file, before anything
imports huggingface_hub or transformers: they read these variables once, at import. (Set any later, as this file
used to, HF_HUB_OFFLINE is ignored, and every hub lookup, e.g. an export reading a target's config, waits ~20 s for
the unreachable hub before falling back: 11 such tests made a quarter of the suite's time.)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

# Reused if this file is imported twice in one session (``from tests.conftest import ...`` under another name).
_SESSION_ROOT = Path(os.environ.get("SPECDRAFT_TEST_SESSION") or tempfile.mkdtemp(prefix="specdraft-tests-"))
os.environ["SPECDRAFT_TEST_SESSION"] = str(_SESSION_ROOT)
# XDG_CACHE_HOME stays: compiled torch extensions (DeepSpeed's CPU shm op, a minute or two to build) are kept across
# sessions there, as torch does by default; every library cache the tests fill is moved below instead.
for _var, _sub in {"SPECDRAFT_CACHE": "specdraft-cache", "HF_HOME": "hf", "TORCH_HOME": "torch",
                   "MPLCONFIGDIR": "matplotlib", "TRITON_CACHE_DIR": "triton", "WANDB_DIR": "wandb",
                   "WANDB_CACHE_DIR": "wandb-cache", "WANDB_CONFIG_DIR": "wandb-config", "WANDB_DATA_DIR": "wandb-data",
                   "XDG_CONFIG_HOME": "xdg-config", "XDG_DATA_HOME": "xdg-data"}.items():
    os.environ[_var] = str(_SESSION_ROOT / _sub)
# One thread per process, subprocesses included: pytest-xdist runs two workers on two cores, each of which may start
# ranks of its own; more threads only oversubscribe the cores.
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
os.environ.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                  HF_HUB_DISABLE_TELEMETRY="1", WANDB_SILENT="true")

import pytest  # noqa: E402  (after the environment above)
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from distill.teacher import Teacher  # noqa: E402

from tests.eager_reference import install as install_eager_reference  # noqa: E402

install_eager_reference()  # the eager proposals the static drafts are tested against (tests/eager_reference.py)

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)  # OMP_NUM_THREADS above


def pytest_collection_modifyitems(config, items) -> None:
    """A test module's ``SLOW_CASES`` (test names with their ids, e.g. ``test_x[llama-medusa]``) are marked slow: the
    cases of a matrix whose one axis is a parametrized fixture, which ``pytest.param(..., marks=...)`` cannot reach.
    (Runs before ``-m`` deselects: conftest hooks come ahead of pytest's own.)"""
    for item in items:
        if item.name in getattr(getattr(item, "module", None), "SLOW_CASES", ()):
            item.add_marker(pytest.mark.slow)


def pytest_unconfigure(config) -> None:
    if not hasattr(config, "workerinput"):  # a pytest-xdist worker leaves the shared root to the controller
        shutil.rmtree(_SESSION_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_toy_target():
    """``(model, tokenizer)`` of ``conf/target/tiny.yaml``'s toy target, built once per session into the session's
    ``SPECDRAFT_CACHE``, where CLI subprocesses started by tests (``target=tiny``) find it instead of building their
    own. Treat the model as read-only: it is shared."""
    from distill.toy import default_cache_dir, load_or_build_toy_target

    toy = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "target" / "tiny.yaml"))["toy"]
    lock = default_cache_dir() / ".tiny-toy-build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:  # pytest-xdist workers share the cache: one builds, the others wait and load
        fcntl.flock(held, fcntl.LOCK_EX)
        return load_or_build_toy_target(toy)


def make_tiny_llama(seed: int = 0, vocab_size: int = 128, **overrides) -> LlamaForCausalLM:
    """A tiny random Llama (any ``LlamaConfig`` field overridable), seeded: equal arguments, equal weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=256, tie_word_embeddings=True), **overrides})
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_target() -> LlamaForCausalLM:
    return make_tiny_llama()


@pytest.fixture
def tiny_teacher(tiny_target) -> Teacher:
    return Teacher(tiny_target, tokenizer=None, name="tiny-llama")


@pytest.fixture
def teacher() -> Teacher:
    """A tiny target with larger initial weights: at ``tiny_target``'s 0.02 init the logits are near-uniform and
    greedy output repeats one token, which would exercise neither rejections nor an EOS."""
    return Teacher(make_tiny_llama(initializer_range=0.2), tokenizer=None, name="tiny-llama-varied")


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
