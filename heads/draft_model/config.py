"""A draft model's Hugging Face side: its config derived from the target's (``drafter.config_overrides``), its
weights initialised from the target's, a model rebuilt from a saved config, tied parameters saved once, and the
toy draft node that shares the toy target's tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


# What fixes the toy BPE tokenizer: a toy draft model must share these with the toy target.
TOY_TOKENIZER_KEYS = ("vocab_size", "max_seq_len", "corpus_max_bytes", "seed")


def toy_draft_node(draft_node: Mapping[str, Any], target_toy: Mapping[str, Any], **sizes) -> dict:
    """A ``drafter=draft_model`` node for a toy target: its ``toy`` build takes ``sizes`` (hidden_size, steps, ...)
    and the target's tokenizer-defining keys, so the two tokenizers are identical (``bind_target`` checks it)."""
    node = dict(draft_node)
    node["source"] = "toy"
    node["toy"] = {**dict(node.get("toy") or {}), **sizes, **{k: target_toy[k] for k in TOY_TOKENIZER_KEYS}}
    return node


@torch.no_grad()
def init_from_target(model: nn.Module, target: nn.Module, init: str) -> None:
    """Copy the target's tensors into a fresh draft built from its config: embeddings, final norm and lm_head
    (``init=embeddings``), plus every layer the draft has (``truncated``: the target's first layers)."""
    if init == "none":
        return
    mine, theirs = model.state_dict(), target.state_dict()
    shared = [k for k in mine if k in theirs and mine[k].shape == theirs[k].shape]
    if init == "embeddings":
        shared = [k for k in shared if ".layers." not in k]
    if not shared:
        raise ValueError("drafter.init: no tensor of the draft model matches the target's by name and shape; "
                         "use drafter.init=none")
    model.load_state_dict({k: theirs[k].to(mine[k].dtype) for k in shared}, strict=False)


def draft_config(target_config, overrides: Mapping[str, Any]):
    """The target's config with ``overrides`` (``drafter.config_overrides``), built through the config class so its
    own checks run now rather than when the saved drafter is loaded. Per-layer lists (``layer_types``: Qwen2/3's and
    Gemma-2/3's sliding / full pattern; any list as long as the target has layers) follow a changed
    ``num_hidden_layers``: a shallower draft keeps the target's first layers' entries."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    fields = target_config.to_dict()
    for key in overrides:
        if key not in fields:
            raise ValueError(f"drafter.config_overrides.{key}: the target's {type(target_config).__name__} has no such "
                             f"field; valid fields include num_hidden_layers, intermediate_size, num_attention_heads")
    L, n = fields.get("num_hidden_layers"), overrides.get("num_hidden_layers", fields.get("num_hidden_layers"))
    derived = {}
    if n != L:
        for key, value in fields.items():
            if key in overrides or not isinstance(value, list) or len(value) != L:
                continue
            if n > L:
                raise ValueError(f"drafter.config_overrides.num_hidden_layers={n} is deeper than the target ({L} "
                                 f"layers) and its config has the per-layer list {key!r}; give "
                                 f"drafter.config_overrides.{key} with {n} entries")
            derived[key] = value[:n]
    try:
        return AutoConfig.for_model(**{**fields, **dict(overrides), **derived})
    except (ValueError, TypeError, StrictDataclassError) as e:  # the config class's own checks
        raise ValueError(f"drafter.config_overrides={dict(overrides)} does not make a valid "
                         f"{type(target_config).__name__}: {e}") from None


def model_from_config(model_config: Mapping[str, Any]) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if "model_type" not in model_config:
        raise ValueError("drafter.model_config has no model_type; it must be a saved `model.config.to_dict()`")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**model_config)).eval()


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Parameter name -> the first name of the same tensor, for every later name of a shared (tied) parameter."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def drop_tied_aliases(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for alias in tied_aliases(module):
        state_dict.pop(prefix + alias, None)


def restore_tied_aliases(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    for alias, source in tied_aliases(module).items():
        if prefix + source in state_dict and prefix + alias not in state_dict:
            state_dict[prefix + alias] = state_dict[prefix + source]
