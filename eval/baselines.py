"""Hugging Face ``generate`` as reference points: plain decoding (eager, and on CUDA with the static cache it
compiles), and assisted generation — the peer to beat.

Both run with the same decoding rule as ``inference.decoder`` (greedy, or temperature -> top-k -> top-p sampling
from ``SamplingConfig``) and nothing else: the model's own ``generation_config`` (hub checkpoints ship a
repetition penalty, a default top_k of 50, sampling on, ...) is swapped out for the call, so a difference in
output or speed is the decoding machinery's, not a setting's. Assisted generation drafts a constant
``num_draft`` tokens per target forward (no heuristic schedule, no confidence early stop), the same γ as ours.

Shapes: prompt_ids [1, n] -> new_tokens: up to max_new_tokens ids, ending at the first EOS when one is produced.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
from torch import Tensor
from transformers import GenerationConfig

from inference.sampling import SamplingConfig


@contextlib.contextmanager
def _generation_config(model, config: GenerationConfig) -> Iterator[None]:
    """Let ``generate`` see only ``config``: it fills every unset field from ``model.generation_config``."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved


def _decoding_kwargs(teacher, sampling: SamplingConfig, max_new_tokens: int, eos_token_id: int | None) -> dict:
    tokenizer = getattr(teacher, "tokenizer", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    # A batch of one is never padded; pad_token_id is set only so that generate does not warn and pick one itself.
    pad = pad if pad is not None else (eos_token_id if eos_token_id is not None else 0)
    # eos_token_id=None is passed explicitly: like our decoder, then only max_new_tokens stops generation.
    kw = {"max_new_tokens": max_new_tokens, "eos_token_id": eos_token_id, "pad_token_id": pad}
    if sampling.greedy:
        return {**kw, "do_sample": False}
    # top_k=0 must be explicit: generate's own default is 50. HF applies temperature, top-k, top-p in our order.
    return {**kw, "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}


def _timed_generate(teacher, prompt_ids: Tensor, kwargs: dict, seed: int) -> dict:
    model, device = teacher.model, teacher.device
    prompt_ids = prompt_ids.to(device)
    # Sampling draws from the global RNG; fork it so the seed does not leak into (or depend on) the caller's state.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        if device.type == "cuda":  # timings must cover the kernels, not just their launch
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = model.generate(prompt_ids, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    return {"new_tokens": out[0, prompt_ids.shape[1]:].tolist(), "seconds": seconds}


def hf_generate(teacher, prompt_ids: Tensor, max_new_tokens: int, sampling: SamplingConfig,
                eos_token_id: int | None, seed: int = 0) -> dict:
    """Plain ``teacher.model.generate``: {"new_tokens": list[int], "seconds": float}."""
    kwargs = _decoding_kwargs(teacher, sampling, max_new_tokens, eos_token_id)
    with _generation_config(teacher.model, GenerationConfig()):
        return _timed_generate(teacher, prompt_ids, kwargs, seed)


def hf_generate_static(teacher, prompt_ids: Tensor, max_new_tokens: int, sampling: SamplingConfig,
                       eos_token_id: int | None, seed: int = 0) -> dict:
    """``generate(cache_implementation="static")``: transformers' static cache, whose decode step ``generate``
    compiles with CUDA graphs on a CUDA device (the best plain decoding a user of transformers already has); the
    first call of a shape pays the compilation. {"new_tokens": list[int], "seconds": float}."""
    kwargs = {**_decoding_kwargs(teacher, sampling, max_new_tokens, eos_token_id), "cache_implementation": "static"}
    with _generation_config(teacher.model, GenerationConfig()):
        return _timed_generate(teacher, prompt_ids, kwargs, seed)


def hf_assisted(teacher, assistant_model, prompt_ids: Tensor, max_new_tokens: int, num_draft: int,
                sampling: SamplingConfig, eos_token_id: int | None, seed: int = 0) -> dict:
    """HF assisted generation with ``assistant_model`` drafting ``num_draft`` tokens per target forward.

    HF's candidate generator reads the draft length, its schedule and the confidence early stop from the
    assistant's ``generation_config`` (``transformers.generation.candidate_generator``); the defaults (threshold
    0.4, tuned online by an ROC fit when sklearn is installed) would stop drafts early, so γ would not be ours.
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    if assistant_model.get_output_embeddings().weight.shape[0] != teacher.vocab_size:
        raise ValueError(
            f"assistant model has {assistant_model.get_output_embeddings().weight.shape[0]} output rows, the target "
            f"{teacher.vocab_size}; a draft model must share the target's tokenizer"
        )
    assistant = GenerationConfig(num_assistant_tokens=num_draft, num_assistant_tokens_schedule="constant",
                                 assistant_confidence_threshold=0.0)
    kwargs = {**_decoding_kwargs(teacher, sampling, max_new_tokens, eos_token_id), "assistant_model": assistant_model}
    with _generation_config(teacher.model, GenerationConfig()), _generation_config(assistant_model, assistant):
        return _timed_generate(teacher, prompt_ids, kwargs, seed)
