"""The embedded "toy target": a small Llama pretrained here on stdlib source.

No model weights can be downloaded in the environments this project must run
in, so the default frozen target is built locally: a byte-level BPE tokenizer
and a small ``LlamaForCausalLM`` trained for a fixed number of steps on the
interpreter's own standard library (``distill.corpus``). The build runs once
per machine and config; the result is cached under
``<cache_dir>/toy-<key>/`` and loaded from there afterwards.

The cache key covers the corpus content, the config and a format version, so
a different Python (different stdlib) or config gets its own target instead of
silently reusing a mismatched one.

Run ``python -m distill.toy`` to build (or load) the default target.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import pathlib
import shutil
import statistics
import tempfile
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from distill.corpus import corpus_fingerprint, stdlib_sources

logger = logging.getLogger(__name__)

Sources = list[tuple[str, str]]  # (relpath, text), as distill.corpus returns them
PathArg = str | os.PathLike | None

# Bump when the build recipe changes in a way that makes old caches wrong.
FORMAT_VERSION = "toy-v1"

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BUILD_INFO = "build_info.json"
# A cache dir counts as complete only with all of these; build_info is written last.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", BUILD_INFO)
_MAX_EVAL_BLOCKS = 64
_EVAL_BATCH = 16

@dataclass
class ToyTargetConfig:
    """``target.toy``: the toy target's architecture and pretraining budget (in steps, not minutes)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 256
    steps: int = 2000
    batch_size: int = 8
    lr: float = 4e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    corpus_max_bytes: Optional[int] = None
    autocast_bf16: bool = True


DEFAULT_TOY_CFG: dict[str, Any] = asdict(ToyTargetConfig())


def _key_types() -> dict[str, tuple[tuple[type, ...], bool]]:
    """key -> (accepted types, whether None is allowed), read off ``ToyTargetConfig`` so the two cannot drift.

    A float key also takes an int (``lr=1``); bool is checked apart in ``_check_value`` because
    isinstance(True, int) holds and a bool step count is surely a typo.
    """
    out = {}
    for key, hint in typing.get_type_hints(ToyTargetConfig).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if args else hint
        out[key] = ((int, float) if base is float else (base,), type(None) in typing.get_args(hint))
    return out


_KEY_TYPES = _key_types()


# --------------------------------------------------------------------------- config


def _check_value(key: str, value: Any) -> Any:
    types, nullable = _KEY_TYPES[key]
    if value is None and nullable:
        return None
    is_bool = isinstance(value, bool)
    if (is_bool and bool not in types) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
        raise ValueError(
            f"target.toy.{key}={value!r} has type {type(value).__name__}; set it to a {names}"
        )
    if float in types:
        return float(value)  # so lr=4e-3 and lr=0.004 share one cache key
    return value


def validate_toy_cfg(toy_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check every key of ``toy_cfg`` and return a normalized plain dict."""
    cfg: dict[str, Any] = {}
    for key in _KEY_TYPES:
        if key not in toy_cfg:
            raise ValueError(
                f"missing config key target.toy.{key}; add it (default: {DEFAULT_TOY_CFG[key]!r})"
            )
        cfg[key] = _check_value(key, toy_cfg[key])
    extra = sorted(set(toy_cfg) - set(_KEY_TYPES))
    if extra:
        logger.warning("ignoring unknown keys target.toy.%s", ", target.toy.".join(extra))
    _check_ranges(cfg)
    return cfg


def _check_ranges(cfg: Mapping[str, Any]) -> None:
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "max_seq_len", "steps", "batch_size", "lr")
    for key in positive:
        if cfg[key] <= 0:
            raise ValueError(f"target.toy.{key}={cfg[key]!r} must be > 0")
    if cfg["vocab_size"] < 258:
        raise ValueError(
            f"target.toy.vocab_size={cfg['vocab_size']} is below 258, the 256 byte "
            "tokens plus 2 special tokens; raise it"
        )
    if cfg["hidden_size"] % cfg["num_heads"]:
        raise ValueError(
            f"target.toy.hidden_size={cfg['hidden_size']} is not divisible by "
            f"target.toy.num_heads={cfg['num_heads']}; pick a head count that divides it"
        )
    if not 0 <= cfg["warmup_steps"] <= cfg["steps"]:
        raise ValueError(
            f"target.toy.warmup_steps={cfg['warmup_steps']} must be in [0, steps={cfg['steps']}]"
        )


# --------------------------------------------------------------------------- cache


def _default_cache_dir() -> pathlib.Path:
    env = os.environ.get("SPECDRAFT_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "specdraft"


def _cache_key(cfg: Mapping[str, Any], fingerprint: str) -> str:
    canonical = json.dumps(cfg, sort_keys=True, separators=(",", ":"))
    material = f"{fingerprint}\n{canonical}\n{FORMAT_VERSION}"
    return hashlib.sha256(material.encode("utf-8")).hexdigest()[:16]


def _load_corpus(cfg: Mapping[str, Any]) -> tuple[Sources, Sources, str]:
    train = stdlib_sources("train", max_bytes=cfg["corpus_max_bytes"])
    heldout = stdlib_sources("heldout")
    # Heldout is part of the key because build_info records metrics on it.
    return train, heldout, corpus_fingerprint(train + heldout)


def _resolve_path(cfg: Mapping[str, Any], fingerprint: str, cache_dir: PathArg) -> pathlib.Path:
    root = pathlib.Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    return root.expanduser() / f"toy-{_cache_key(cfg, fingerprint)}"


def toy_cache_path(toy_cfg: Mapping[str, Any], cache_dir: PathArg = None) -> pathlib.Path:
    """Directory the toy target for ``toy_cfg`` lives in (whether built yet or not)."""
    cfg = validate_toy_cfg(toy_cfg)
    _, _, fingerprint = _load_corpus(cfg)
    return _resolve_path(cfg, fingerprint, cache_dir)


def _is_complete(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _load(path: pathlib.Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(
    texts: Sequence[str], vocab_size: int, max_seq_len: int
) -> PreTrainedTokenizerFast:
    """Byte-level BPE over ``texts``: every string round-trips, no unknown tokens."""
    tok = Tokenizer(models.BPE())
    # No prefix space: code must decode back byte for byte.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # All 256 bytes up front, so bytes absent from the corpus still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() < vocab_size:
        logger.warning(
            "tokenizer has %d tokens, fewer than target.toy.vocab_size=%d: the corpus "
            "ran out of merges; the model keeps %d embedding rows",
            tok.get_vocab_size(), vocab_size, vocab_size,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=max_seq_len,
        # The default clean-up would turn "x ." into "x." and break code.
        clean_up_tokenization_spaces=False,
    )


def tokenize_blocks(
    tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], seq_len: int
) -> torch.Tensor:
    """Concatenate ``text + <|endoftext|>`` for every text; cut into ``[N, seq_len]``."""
    encodings = tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    eos_id = tokenizer.eos_token_id
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(eos_id)
    num_blocks = len(ids) // seq_len
    if num_blocks == 0:
        raise ValueError(
            f"corpus has {len(ids)} tokens, fewer than one block of target.toy.max_seq_len="
            f"{seq_len}; raise target.toy.corpus_max_bytes or lower max_seq_len"
        )
    # The tail shorter than one block is dropped; it is < seq_len tokens.
    return torch.tensor(ids[: num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)


# --------------------------------------------------------------------------- model + training


def _make_model(cfg: Mapping[str, Any], tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"],
        num_key_value_heads=cfg["num_heads"],
        max_position_embeddings=cfg["max_seq_len"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg["seed"])  # deterministic init for a given seed
    return LlamaForCausalLM(config)


def _make_optimizer(model: torch.nn.Module, cfg: Mapping[str, Any]) -> torch.optim.AdamW:
    # Decay matrices only: decaying norms' gains and biases just fights them.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg["weight_decay"]},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95))


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to 1, then cosine down to 0.1 at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def next_token_loss(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of predicting ``ids[:, 1:]`` from ``logits[:, :-1]``."""
    logits_NV = logits_BTV[:, :-1].float().flatten(0, 1)
    return F.cross_entropy(logits_NV, ids_BT[:, 1:].flatten())


def train_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, ids_BT: torch.Tensor,
               use_bf16: bool) -> float:
    """One optimizer step on ``ids_BT``; returns the loss before the update."""
    with _autocast(ids_BT.device, use_bf16):
        logits_BTV = model(input_ids=ids_BT).logits
    loss = next_token_loss(logits_BTV, ids_BT)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def pretrain(
    model: LlamaForCausalLM, blocks_NT: torch.Tensor, cfg: Mapping[str, Any]
) -> dict[str, float]:
    """Train for exactly ``cfg["steps"]`` steps on random blocks; returns timing/loss stats."""
    device = next(model.parameters()).device
    optimizer = _make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg["warmup_steps"], cfg["steps"])
    )
    generator = torch.Generator().manual_seed(cfg["seed"])
    log_every = max(1, cfg["steps"] // 10)
    step_seconds: list[float] = []
    losses: list[float] = []
    model.train()
    bar = tqdm(range(cfg["steps"]), desc="toy target pretrain", unit="step")
    for step in bar:
        start = time.perf_counter()
        rows_B = torch.randint(blocks_NT.shape[0], (cfg["batch_size"],), generator=generator)
        loss = train_step(model, optimizer, blocks_NT[rows_B].to(device), cfg["autocast_bf16"])
        schedule.step()
        step_seconds.append(time.perf_counter() - start)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if (step + 1) % log_every == 0:
            logger.info("step %d/%d loss %.4f", step + 1, cfg["steps"], loss)
    bar.close()
    model.eval()
    tail = losses[-min(50, len(losses)):]  # one step's loss is noisy; average the end
    return {
        "train_seconds": sum(step_seconds),
        "median_step_seconds": statistics.median(step_seconds),
        "final_train_loss": sum(tail) / len(tail),
    }


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, blocks_NT: torch.Tensor) -> tuple[float, float]:
    """Held-out (loss in nats/token, top-1 accuracy) on up to 64 evenly spaced blocks."""
    device = next(model.parameters()).device
    # Evenly spaced, so the sample spans all held-out modules, not just the first.
    num = min(_MAX_EVAL_BLOCKS, blocks_NT.shape[0])
    rows = torch.linspace(0, blocks_NT.shape[0] - 1, num).round().long()
    total_loss, total_correct, total_tokens = 0.0, 0, 0
    model.eval()
    for chunk in rows.split(_EVAL_BATCH):
        ids_BT = blocks_NT[chunk].to(device)
        # fp32, no autocast: these numbers describe the saved float32 model.
        logits_BTV = model(input_ids=ids_BT).logits.float()
        targets = ids_BT[:, 1:]
        count = targets.numel()
        total_loss += next_token_loss(logits_BTV, ids_BT).item() * count
        total_correct += (logits_BTV[:, :-1].argmax(-1) == targets).sum().item()
        total_tokens += count
    return total_loss / total_tokens, total_correct / total_tokens


# --------------------------------------------------------------------------- build


def _build_into(out_dir: pathlib.Path, cfg: Mapping[str, Any], train: Sources,
                heldout: Sources, fingerprint: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    tokenizer = train_tokenizer([text for _, text in train], cfg["vocab_size"], cfg["max_seq_len"])
    tokenizer_seconds = time.perf_counter() - t0
    logger.info("trained tokenizer (%d tokens) in %.1fs", len(tokenizer), tokenizer_seconds)
    train_NT = tokenize_blocks(tokenizer, [text for _, text in train], cfg["max_seq_len"])
    heldout_NT = tokenize_blocks(tokenizer, [text for _, text in heldout], cfg["max_seq_len"])
    logger.info("train split: %d files, %d blocks of %d tokens",
                len(train), train_NT.shape[0], cfg["max_seq_len"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _make_model(cfg, tokenizer).to(device)
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
        "steps": cfg["steps"],
        "tokenizer_seconds": tokenizer_seconds,
        **stats,
        "seconds": time.perf_counter() - t0,
        "heldout_loss": heldout_loss,
        "heldout_top1": heldout_top1,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "config": dict(cfg),
    }
    # Written last: its presence is what marks the directory complete.
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _build_atomically(final: pathlib.Path, cfg: Mapping[str, Any], train: Sources,
                      heldout: Sources, fingerprint: str) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    # Same parent as the final dir, so os.replace is a rename on one filesystem.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _build_into(tmp, cfg, train, heldout, fingerprint)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is meant to be shared
        try:
            os.replace(tmp, final)
        except OSError:
            # Renaming onto a non-empty dir fails: another process won the race.
            if not _is_complete(final):
                raise
            logger.info("another process finished %s first; keeping theirs", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_or_build_toy_target(
    toy_cfg: Mapping[str, Any], cache_dir: PathArg = None
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load the cached toy target for ``toy_cfg``, building it first if needed.

    ``cache_dir`` defaults to $SPECDRAFT_CACHE, else ~/.cache/specdraft. The
    model comes back in float32, on the CPU, in eval mode.
    """
    cfg = validate_toy_cfg(toy_cfg)
    train, heldout, fingerprint = _load_corpus(cfg)
    path = _resolve_path(cfg, fingerprint, cache_dir)
    if path.exists() and not _is_complete(path):
        raise RuntimeError(
            f"toy target cache {path} exists but lacks some of {_REQUIRED_FILES} "
            "(not written by this code, or damaged); delete that directory and rerun"
        )
    if not path.exists():
        logger.info("building toy target into %s (one-off; later runs load it)", path)
        # The build seeds and draws; the caller's random streams (CPU and every GPU) must not see it.
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
            _build_atomically(path, cfg, train, heldout, fingerprint)
    model, tokenizer = _load(path)
    logger.info("loaded toy target from %s", path)
    return model, tokenizer


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (or load) the default toy target.")
    parser.add_argument("--cache-dir", default=None,
                        help="default: $SPECDRAFT_CACHE, else ~/.cache/specdraft")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_or_build_toy_target(DEFAULT_TOY_CFG, args.cache_dir)
    path = toy_cache_path(DEFAULT_TOY_CFG, args.cache_dir)
    # The CLI's output is the build record itself, for humans and scripts alike.
    print((path / BUILD_INFO).read_text(), end="")


if __name__ == "__main__":
    main()
