"""The embedded "toy target": a small Llama pretrained here on stdlib source.

No model weights can be downloaded in the environments this project must run in, so the default frozen target is
built locally: a byte-level BPE tokenizer and a small ``LlamaForCausalLM`` trained for a fixed number of steps on the
interpreter's own standard library (``distill.corpus``). The build runs once per machine and config; the result is
cached under ``<cache_dir>/toy-<key>/`` and loaded from there afterwards.

A small pretraining project of its own, one module per concern:
- ``config``: ``ToyTargetConfig`` (``target.toy``), the schema and its one validator;
- ``tokenizer``: byte-level BPE training, the corpus cut into blocks;
- ``pretrain``: the model, the optimizer, the loop (the project's one LR schedule, ``distill.schedule``), evaluation;
- ``cache``: the cache key and directory, completeness, loading;
- ``build``: build atomically into the cache, or load (``load_or_build_toy_target``).

Run ``python -m distill.toy`` to build (or load) the default target.
"""

from distill.toy.build import build_into, load_or_build_toy_target, toy_cache_path
from distill.toy.cache import BUILD_INFO, FORMAT_VERSION, cache_key, default_cache_dir
from distill.toy.config import DEFAULT_TOY_CFG, ToyTargetConfig, toy_config
from distill.toy.pretrain import lr_factor
from distill.toy.tokenizer import EOS_TOKEN, PAD_TOKEN, tokenize_blocks, train_tokenizer

__all__ = [
    "BUILD_INFO", "DEFAULT_TOY_CFG", "EOS_TOKEN", "FORMAT_VERSION", "PAD_TOKEN", "ToyTargetConfig", "build_into",
    "cache_key", "default_cache_dir", "load_or_build_toy_target", "lr_factor", "tokenize_blocks", "toy_cache_path",
    "toy_config", "train_tokenizer",
]
