"""Shared fixtures: a tiny real Llama built in-process (no hub), wrapped as a frozen teacher."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distill.teacher import Teacher

# Keep third-party state out of the user's home during tests.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # two workers sharing 2 cores collapse badly with more


def make_tiny_llama(seed: int = 0, vocab_size: int = 128, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=256, tie_word_embeddings=True, **overrides,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_target() -> LlamaForCausalLM:
    return make_tiny_llama()


@pytest.fixture
def tiny_teacher(tiny_target) -> Teacher:
    return Teacher(tiny_target, tokenizer=None, name="tiny-llama")


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
