"""A Hugging Face forward over right-padded or packed training rows with plain causal attention: no mask built and
no value read back to the host.

With no attention mask, transformers still builds one: it reads the position ids back to the host to look for
packed sequences (and, given a padding mask, whether it is all ones), a device sync per forward. A training row's
padding is only ever at its end (``distill.data``), so causal attention alone is exact at every real position; the
model's own SDPA function, registered under a name of ours that transformers has no mask builder for, is what its
attention layers call inside ``causal_attention``, and transformers then skips mask creation altogether (the path
it keeps for engines that bring their own masks). Models whose attention is more than causal (sliding windows,
soft-capped logits) or that do not run SDPA keep their own path.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from torch import nn

log = logging.getLogger(__name__)

CAUSAL = "specdraft_causal"
_registered: bool | None = None  # None: not tried yet; False: this transformers cannot take it


def _register() -> bool:
    global _registered
    if _registered is None:
        try:
            import inspect

            from transformers import AttentionInterface, masking_utils
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            # the skip this relies on: mask creation returns early for an implementation it has no builder for
            if "ALL_MASK_ATTENTION_FUNCTIONS" not in inspect.getsource(masking_utils._preprocess_mask_arguments):
                raise AttributeError("this transformers builds masks for every attention implementation")
            AttentionInterface.register(CAUSAL, sdpa_attention_forward)
            _registered = True
        except (ImportError, AttributeError, OSError, TypeError) as e:  # another transformers: its own mask path
            log.info("causal training forwards keep transformers' mask path: %s", e)
            _registered = False
    return _registered


def plain_causal(config) -> bool:
    """Whether every attention layer of ``config``'s model is causal SDPA with nothing on top: no sliding window, no
    logit soft-capping, no other kernel chosen."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(text, "attn_logit_softcapping", None) or getattr(text, "sliding_window", None):
        return False
    types = getattr(text, "layer_types", None)
    return types is None or all(t == "full_attention" for t in types)


@contextlib.contextmanager
def causal_attention(model: nn.Module) -> Iterator[None]:
    """Inside this block ``model``'s forwards (called with no attention mask) run causal SDPA with no mask built and
    no host read-back, where that is exact (``plain_causal``); elsewhere a no-op."""
    config = getattr(model, "config", None)
    if config is None or not plain_causal(config) or not _register():
        yield
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    configs = {id(c): c for c in (config, text)}.values()
    for c in configs:
        c._attn_implementation = CAUSAL
    try:
        yield
    finally:
        for c in configs:
            c._attn_implementation = "sdpa"
