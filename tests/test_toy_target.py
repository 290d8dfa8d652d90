"""Tests for the stdlib corpus and the embedded toy target (CPU, seconds).

Most tests run against a small fake stdlib in a tmp dir (monkeypatched
``stdlib_root``) so they are hermetic and fast; one checks the real stdlib's
splits, since that is what the default target is trained on.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from distill import corpus, toy

TINY_CFG = {
    **toy.DEFAULT_TOY_CFG,
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "max_seq_len": 64,
    "steps": 5,
    "batch_size": 4,
    "warmup_steps": 2,
}

TinyBuild = tuple[pathlib.Path, LlamaForCausalLM, PreTrainedTokenizerFast]

EXCLUDED_COMPONENTS = {"test", "tests", "idle_test", "encodings", "site-packages",
                       "dist-packages", "__pycache__"}


def _fake_module(name: str, num_funcs: int) -> str:
    """Code-like text with indentation and non-ASCII, enough for a few BPE merges."""
    lines = [f'"""Module {name}: naïve café ✓ 日本."""', "import os", ""]
    for i in range(num_funcs):
        lines += [
            f"def {name}_func_{i}(x, y={i}):",
            f"    if x > {i}:",
            f"        return x * y + {i}  # über",
            "    return None",
            "",
        ]
    return "\n".join(lines)


FAKE_FILES = {
    "os.py": _fake_module("os", 60),
    "collections/__init__.py": _fake_module("collections", 60),
    "collections/abc.py": _fake_module("abc", 30),
    "zipfile.py": _fake_module("zipfile", 60),
    # Held out (first path component is in HELDOUT_MODULES).
    "argparse.py": _fake_module("argparse", 40),
    "json/__init__.py": _fake_module("json", 20),
    "json/decoder.py": _fake_module("decoder", 20),
    # Excluded one way or another.
    "test/test_os.py": "x = 1\n",
    "ctypes/test/test_x.py": "x = 1\n",
    "lib2to3/tests/data.py": "x = 1\n",
    "idlelib/idle_test/t.py": "x = 1\n",
    "encodings/utf_8.py": "x = 1\n",
    "site-packages/pkg/mod.py": "x = 1\n",
    "__pycache__/os.py": "x = 1\n",
    "README.txt": "not python\n",
}


def _write_fake_stdlib(root: pathlib.Path) -> None:
    for relpath, text in FAKE_FILES.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")  # not UTF-8: must be skipped


@pytest.fixture
def fake_stdlib(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    root = tmp_path / "stdlib"
    _write_fake_stdlib(root)
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    return root


# --------------------------------------------------------------------------- corpus


def test_real_stdlib_splits_are_disjoint_nonempty_and_clean() -> None:
    train = corpus.stdlib_sources("train")
    heldout = corpus.stdlib_sources("heldout")
    assert train and heldout
    train_paths = [p for p, _ in train]
    heldout_paths = [p for p, _ in heldout]
    assert not set(train_paths) & set(heldout_paths)
    assert train_paths == sorted(train_paths)
    for path in train_paths + heldout_paths:
        assert not set(pathlib.PurePosixPath(path).parts) & EXCLUDED_COMPONENTS, path
    heldout_modules = {pathlib.PurePosixPath(p).parts[0].removesuffix(".py") for p in heldout_paths}
    assert heldout_modules <= set(corpus.HELDOUT_MODULES)
    assert "json" in heldout_modules and "argparse" in heldout_modules


def test_fake_stdlib_splits(fake_stdlib: pathlib.Path) -> None:
    train = dict(corpus.stdlib_sources("train"))
    heldout = dict(corpus.stdlib_sources("heldout"))
    assert sorted(train) == ["collections/__init__.py", "collections/abc.py", "os.py", "zipfile.py"]
    assert sorted(heldout) == ["argparse.py", "json/__init__.py", "json/decoder.py"]
    assert train["os.py"] == FAKE_FILES["os.py"]


def test_max_bytes_keeps_sorted_prefix(fake_stdlib: pathlib.Path) -> None:
    everything = corpus.stdlib_sources("train")
    first = corpus.stdlib_sources("train", max_bytes=1)
    assert first == everything[:1]
    budget = len(everything[0][1].encode()) + 1  # just over one file
    assert corpus.stdlib_sources("train", max_bytes=budget) == everything[:2]
    with pytest.raises(ValueError, match="max_bytes"):
        corpus.stdlib_sources("train", max_bytes=0)


def test_unknown_split_names_valid_ones() -> None:
    with pytest.raises(ValueError, match="validation") as info:
        corpus.stdlib_sources("validation")
    assert "train" in str(info.value) and "heldout" in str(info.value)


def test_stdlib_env_points_the_corpus_at_another_tree(tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "other-python-stdlib"
    _write_fake_stdlib(root)
    monkeypatch.setenv(corpus.STDLIB_ENV, str(root))
    assert corpus.stdlib_root() == root
    assert sorted(dict(corpus.stdlib_sources("heldout"))) == ["argparse.py", "json/__init__.py", "json/decoder.py"]
    monkeypatch.setenv(corpus.STDLIB_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="SPECDRAFT_STDLIB"):
        corpus.stdlib_root()


def test_empty_stdlib_is_a_clear_error(tmp_path: pathlib.Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="no readable .py files"):
        corpus.stdlib_sources("train")


def test_fingerprint_stable_and_content_sensitive(fake_stdlib: pathlib.Path) -> None:
    before = corpus.corpus_fingerprint(corpus.stdlib_sources("train"))
    assert before == corpus.corpus_fingerprint(corpus.stdlib_sources("train"))
    assert len(before) == 64
    (fake_stdlib / "os.py").write_text(FAKE_FILES["os.py"] + "\n# edited\n", encoding="utf-8")
    assert corpus.corpus_fingerprint(corpus.stdlib_sources("train")) != before
    # Moving text across the path/content boundary must not collide.
    assert corpus.corpus_fingerprint([("ab", "c")]) != corpus.corpus_fingerprint([("a", "bc")])


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("key", sorted(toy.DEFAULT_TOY_CFG))
def test_missing_key_is_named(key: str, tmp_path: pathlib.Path) -> None:
    cfg = {k: v for k, v in TINY_CFG.items() if k != key}
    with pytest.raises(ValueError, match=f"target.toy.{key}"):
        toy.load_or_build_toy_target(cfg, tmp_path)


def test_bad_values_are_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="target.toy.steps='5'"):
        toy.load_or_build_toy_target({**TINY_CFG, "steps": "5"}, tmp_path)
    with pytest.raises(ValueError, match="target.toy.num_heads"):
        toy.load_or_build_toy_target({**TINY_CFG, "num_heads": 3}, tmp_path)
    with pytest.raises(ValueError, match="target.toy.autocast_bf16"):
        toy.load_or_build_toy_target({**TINY_CFG, "autocast_bf16": 1}, tmp_path)


def test_lr_schedule_warms_up_then_decays_to_ten_percent() -> None:
    cfg = toy.toy_config({**TINY_CFG, "warmup_steps": 10, "steps": 100})
    factors = [toy.lr_factor(step, cfg) for step in range(100)]
    assert factors[0] == pytest.approx(0.1)
    assert factors[9] == pytest.approx(1.0)
    assert max(factors) == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))


@pytest.mark.parametrize("steps,warmup", [(2000, 100), (150, 15), (5, 2), (1, 0), (7, 0)])
def test_lr_schedule_is_bit_identical_to_the_one_existing_toy_targets_were_built_with(steps: int, warmup: int) -> None:
    """The toy now uses the project's one schedule (distill.schedule); a cached target keeps its key, so a rebuild
    under that key must train with exactly the learning rates the old private schedule gave (this expression)."""
    def before(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - 1 - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    cfg = toy.toy_config({**TINY_CFG, "steps": steps, "warmup_steps": warmup})
    assert [toy.lr_factor(step, cfg) for step in range(steps)] == [before(step) for step in range(steps)]


def test_cache_key_of_the_default_config_is_unchanged() -> None:
    """Every user's built default target (a 30-minute build) is found by this key: the config's canonical form and
    the format version must hash as they did when it was built (value computed on main before the toy package split;
    the corpus fingerprint is fixed here because it depends on the machine's stdlib)."""
    assert toy.cache_key(toy.toy_config(toy.DEFAULT_TOY_CFG), "0" * 64) == "62430a6665991ee9"
    assert toy.cache_key(toy.ToyTargetConfig(), "0" * 64) == "62430a6665991ee9"


def test_cache_path_honours_env_and_config(fake_stdlib: pathlib.Path, tmp_path: pathlib.Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "envcache"))
    path = toy.toy_cache_path(TINY_CFG)
    assert path.parent == tmp_path / "envcache" and path.name.startswith("toy-")
    assert toy.toy_cache_path(TINY_CFG, tmp_path / "other").parent == tmp_path / "other"
    assert toy.toy_cache_path({**TINY_CFG, "seed": 1}).name != path.name
    # Equal values spelled differently share one cache entry.
    spelled_out = toy.toy_cache_path({**TINY_CFG, "lr": 0.004})
    assert spelled_out == toy.toy_cache_path({**TINY_CFG, "lr": 4e-3})


# --------------------------------------------------------------------------- tiny build


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyBuild]:
    """One tiny end-to-end build shared by the tests below (fake stdlib, tmp cache)."""
    base = tmp_path_factory.mktemp("toy")
    _write_fake_stdlib(base / "stdlib")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "stdlib_root", lambda: base / "stdlib")
        model, tokenizer = toy.load_or_build_toy_target(TINY_CFG, base / "cache")
        yield base, model, tokenizer


def test_tiny_build_returns_eval_model_and_tokenizer(tiny_build) -> None:
    _, model, tokenizer = tiny_build
    assert isinstance(model, LlamaForCausalLM)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.tie_word_embeddings
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    ids_BT = torch.tensor([tokenizer.encode("def f(x):\n    return x\n")])
    with torch.no_grad():
        logits_BTV = model(input_ids=ids_BT).logits
    assert logits_BTV.shape == (1, ids_BT.shape[1], TINY_CFG["vocab_size"])


@pytest.mark.parametrize("text", [
    "def f(x):\n    if x:\n\t\treturn 'café ✓ 日本'  # trailing  \n\n",
    "x = [1 , 2 ] ; y = x . copy ( )\r\n",
    "   leading spaces and emoji 🐍\n",
])
def test_tokenizer_round_trips(tiny_build, text: str) -> None:
    _, _, tokenizer = tiny_build
    ids = tokenizer.encode(text)
    assert tokenizer.eos_token_id not in ids  # no specials added implicitly
    assert tokenizer.decode(ids) == text


def test_build_info_and_no_leftovers(tiny_build) -> None:
    base, _, _ = tiny_build
    entries = list((base / "cache").iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("toy-")  # no tmp dirs left
    info = json.loads((entries[0] / toy.BUILD_INFO).read_text())
    assert info["steps"] == 5 and info["config"]["vocab_size"] == 300
    assert info["num_train_tokens"] > 0 and math.isfinite(info["heldout_loss"])
    assert 0.0 <= info["heldout_top1"] <= 1.0
    assert (entries[0] / "model.safetensors").is_file()


def test_second_call_loads_from_cache(tiny_build, monkeypatch: pytest.MonkeyPatch) -> None:
    base, model, _ = tiny_build
    monkeypatch.setattr(corpus, "stdlib_root", lambda: base / "stdlib")
    (path,) = (base / "cache").iterdir()
    mtime = (path / toy.BUILD_INFO).stat().st_mtime_ns

    def must_not_run(*args, **kwargs):
        raise AssertionError("rebuilt a cached toy target")

    monkeypatch.setattr(toy.build, "pretrain", must_not_run)
    monkeypatch.setattr(toy.build, "train_tokenizer", must_not_run)
    again, _ = toy.load_or_build_toy_target(TINY_CFG, base / "cache")
    assert (path / toy.BUILD_INFO).stat().st_mtime_ns == mtime
    assert toy.toy_cache_path(TINY_CFG, base / "cache") == path
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_incomplete_cache_dir_is_refused(tiny_build, tmp_path: pathlib.Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    base, _, _ = tiny_build
    monkeypatch.setattr(corpus, "stdlib_root", lambda: base / "stdlib")
    path = toy.toy_cache_path(TINY_CFG, tmp_path)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="delete that directory"):
        toy.load_or_build_toy_target(TINY_CFG, tmp_path)


def test_losing_the_race_keeps_the_winner(fake_stdlib: pathlib.Path, tmp_path: pathlib.Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = {**TINY_CFG, "steps": 1, "warmup_steps": 0}
    real_build_into = toy.build_into

    def build_then_lose(out_dir: pathlib.Path, *args, **kwargs):
        info = real_build_into(out_dir, *args, **kwargs)
        # Another process publishes a complete copy while we were building.
        winner = out_dir.parent / out_dir.name.split(".tmp-")[0].lstrip(".")
        winner.mkdir()
        for item in out_dir.iterdir():
            (winner / item.name).write_bytes(item.read_bytes())
        (winner / "winner.marker").write_text("theirs")
        return info

    monkeypatch.setattr(toy.build, "build_into", build_then_lose)
    toy.load_or_build_toy_target(cfg, tmp_path / "cache")
    (path,) = (tmp_path / "cache").iterdir()  # our temp dir is gone
    assert (path / "winner.marker").read_text() == "theirs"
