"""Build the toy target once into its cache entry (atomically), or load the finished one."""

from __future__ import annotations

import json
import logging
import pathlib
import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from distill.atomic import write_dir_atomically
from distill.precision import native_bf16
from distill.toy.cache import (
    BUILD_INFO, FORMAT_VERSION, REQUIRED_FILES, PathArg, Sources, cache_path, is_complete, load, load_corpus,
)
from distill.toy.config import ToyTargetConfig, toy_config
from distill.toy.pretrain import evaluate, make_model, pretrain
from distill.toy.tokenizer import tokenize_blocks, train_tokenizer

logger = logging.getLogger(__name__)


def build_into(out_dir: pathlib.Path, cfg: ToyTargetConfig, train: Sources, heldout: Sources,
               fingerprint: str) -> dict[str, Any]:
    """Tokenizer, pretraining, held-out evaluation; writes the model, the tokenizer and ``build_info.json`` (last)."""
    t0 = time.perf_counter()
    tokenizer = train_tokenizer([text for _, text in train], cfg.vocab_size, cfg.max_seq_len)
    tokenizer_seconds = time.perf_counter() - t0
    logger.info("trained tokenizer (%d tokens) in %.1fs", len(tokenizer), tokenizer_seconds)
    train_NT = tokenize_blocks(tokenizer, [text for _, text in train], cfg.max_seq_len)
    heldout_NT = tokenize_blocks(tokenizer, [text for _, text in heldout], cfg.max_seq_len)
    logger.info("train split: %d files, %d blocks of %d tokens", len(train), train_NT.shape[0], cfg.max_seq_len)
    device = _build_device()
    model = make_model(cfg, tokenizer).to(device)
    stats = pretrain(model, train_NT, cfg)
    heldout_loss, heldout_top1 = evaluate(model, heldout_NT)
    logger.info("held-out loss %.4f nats/token, top-1 %.3f", heldout_loss, heldout_top1)
    model.to("cpu", dtype=torch.float32).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {
        "format_version": FORMAT_VERSION,
        "corpus_fingerprint": fingerprint,
        "num_train_files": len(train),
        "num_train_tokens": train_NT.numel(),
        "num_heldout_tokens": heldout_NT.numel(),
        "steps": cfg.steps,
        "tokenizer_seconds": tokenizer_seconds,
        **stats,
        "seconds": time.perf_counter() - t0,
        "heldout_loss": heldout_loss,
        "heldout_top1": heldout_top1,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "config": asdict(cfg),
    }
    # Written last: its presence is what marks the directory complete.
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _build_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _as_built(cfg: ToyTargetConfig) -> ToyTargetConfig:
    """``autocast_bf16`` only where the build's device computes bf16 natively (``distill.precision``); elsewhere the
    toy pretrains in float32, many times faster than emulated bf16, and is cached under that setting."""
    if cfg.autocast_bf16 and not native_bf16(_build_device()):
        return replace(cfg, autocast_bf16=False)
    return cfg


def toy_cache_path(toy_cfg: Mapping[str, Any] | ToyTargetConfig, cache_dir: PathArg = None) -> pathlib.Path:
    """Directory the toy target for ``toy_cfg`` lives in (whether built yet or not)."""
    cfg = _as_built(toy_config(toy_cfg))
    _, _, fingerprint = load_corpus(cfg)
    return cache_path(cfg, fingerprint, cache_dir)


def load_or_build_toy_target(
    toy_cfg: Mapping[str, Any] | ToyTargetConfig, cache_dir: PathArg = None
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load the cached toy target for ``toy_cfg``, building it first if needed.

    ``cache_dir`` defaults to $SPECDRAFT_CACHE, else ~/.cache/specdraft. The model comes back in float32, on the CPU,
    in eval mode.
    """
    cfg = _as_built(toy_config(toy_cfg))
    train, heldout, fingerprint = load_corpus(cfg)
    path = cache_path(cfg, fingerprint, cache_dir)
    if path.exists() and not is_complete(path):
        raise RuntimeError(
            f"toy target cache {path} exists but lacks some of {REQUIRED_FILES} "
            "(not written by this code, or damaged); delete that directory and rerun"
        )
    if not path.exists():
        logger.info("building toy target into %s (one-off; later runs load it)", path)
        # The build seeds and draws; the caller's random streams (CPU and every GPU) must not see it.
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
            # replace=False: when another process finishes the same entry first, theirs is kept.
            write_dir_atomically(path, lambda tmp: build_into(tmp, cfg, train, heldout, fingerprint), replace=False)
        if not is_complete(path):
            raise RuntimeError(f"toy target cache {path} was published incomplete by another process; delete that "
                               "directory and rerun")
    model, tokenizer = load(path)
    logger.info("loaded toy target from %s", path)
    return model, tokenizer
