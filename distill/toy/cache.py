"""Where a toy target lives: ``<cache_dir>/toy-<key>/``, and how a finished one is recognised and loaded.

The key covers the corpus content, the config and a format version, so a different Python (different stdlib) or
config gets its own target instead of silently reusing a mismatched one. The key must stay stable: every user's
built target (a 30-minute build for the default config) is found by it (tests/test_toy_target.py pins it).
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import asdict

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from distill.corpus import corpus_fingerprint, stdlib_sources
from distill.fingerprint import text_digest
from distill.toy.config import ToyTargetConfig

Sources = list[tuple[str, str]]  # (relpath, text), as distill.corpus returns them
PathArg = str | os.PathLike | None

# Bump when the build recipe changes in a way that makes old caches wrong.
FORMAT_VERSION = "toy-v1"
BUILD_INFO = "build_info.json"
# A cache dir counts as complete only with all of these; build_info is written last.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", BUILD_INFO)


def default_cache_dir() -> pathlib.Path:
    """$SPECDRAFT_CACHE, else ~/.cache/specdraft."""
    env = os.environ.get("SPECDRAFT_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "specdraft"


def cache_key(cfg: ToyTargetConfig, fingerprint: str) -> str:
    """16 hex digits of sha256 over the corpus fingerprint, the canonical config JSON and the format version."""
    canonical = json.dumps(asdict(cfg), sort_keys=True, separators=(",", ":"))
    return text_digest(f"{fingerprint}\n{canonical}\n{FORMAT_VERSION}")[:16]


def load_corpus(cfg: ToyTargetConfig) -> tuple[Sources, Sources, str]:
    """(train sources, held-out sources, fingerprint of both)."""
    train = stdlib_sources("train", max_bytes=cfg.corpus_max_bytes)
    heldout = stdlib_sources("heldout")
    # Heldout is part of the key because build_info records metrics on it.
    return train, heldout, corpus_fingerprint(train + heldout)


def cache_path(cfg: ToyTargetConfig, fingerprint: str, cache_dir: PathArg) -> pathlib.Path:
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root.expanduser() / f"toy-{cache_key(cfg, fingerprint)}"


def is_complete(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def load(path: pathlib.Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    try:
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    except Exception as e:  # a truncated or damaged file (safetensors, JSON, tokenizers each raise their own type)
        raise OSError(f"toy target cache {path} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                           f"delete that directory and rerun: it is rebuilt (same seed, same weights)") from e
    model.eval()
    return model, tokenizer
