"""Tiny random-weight targets of the model families people serve, built in-process from transformers' own config
classes (no downloads): each keeps its family's traits a drafter trainer can trip on, scaled down.

Sizes: 2-4 layers, hidden 64, vocabulary trimmed to 256, GQA (4 query heads, 2 KV heads) wherever the family has it.
What each family keeps is listed in ``traits`` (docs/families.md's table names the same). ``initializer_range``
0.2: transformers' default (0.02) makes a random target repeat one token forever, which tests nothing; at 0.2 the
greedy continuations vary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 256
HIDDEN = 64
WINDOW = 12  # sliding window of the sliding-window families: prompts in the tests are longer
INIT = 0.2
SMALL_MLP = dict(hidden_size=HIDDEN, intermediate_size=128, vocab_size=VOCAB, initializer_range=INIT,
                 max_position_embeddings=512)
GQA = dict(num_attention_heads=4, num_key_value_heads=2)


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type (AutoConfig.for_model)
    flagship: str  # the served model this family stands for (conf/target preset)
    traits: str  # what this tiny target keeps of the family
    kwargs: dict[str, Any]
    # Gemma ties its lm_head to embeddings it scales by sqrt(D): at random init the scaled embedding dominates the
    # residual stream and the tiny target repeats the current token forever; shrinking the embedding table after
    # init (still tied, still scaled) makes it write varied text.
    embed_rescale: float = 1.0

    def config(self):
        return AutoConfig.for_model(self.model_type, **self.kwargs)

    def build(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(self.config()).eval()
        if self.embed_rescale != 1.0:
            with torch.no_grad():
                model.get_input_embeddings().weight.mul_(self.embed_rescale)
        return model


def _gemma(sliding_every: int, **extra) -> dict:
    layers = 4
    types = ["full_attention" if (i + 1) % sliding_every == 0 else "sliding_attention" for i in range(layers)]
    return dict(SMALL_MLP, num_hidden_layers=layers, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                layer_types=types, pad_token_id=0, eos_token_id=1, bos_token_id=2, **GQA, **extra)


FAMILIES: dict[str, Family] = {f.model_type: f for f in [
    Family("llama", "meta-llama/Llama-3.1-8B-Instruct", "llama3 rope scaling (factor 8), GQA, untied embeddings",
           dict(SMALL_MLP, num_hidden_layers=2, **GQA, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    Family("qwen2", "Qwen/Qwen2.5-7B-Instruct", "qkv bias, GQA, per-layer layer_types (all full attention)",
           dict(SMALL_MLP, num_hidden_layers=2, **GQA, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    Family("qwen3", "Qwen/Qwen3-8B", "q/k RMS norms, explicit head_dim, GQA, tied embeddings (as Qwen3 <= 4B)",
           dict(SMALL_MLP, num_hidden_layers=2, head_dim=16, **GQA, tie_word_embeddings=True)),
    Family("mistral", "mistralai/Mistral-7B-Instruct-v0.3",
           f"sliding window {WINDOW} on every layer (as Mistral-7B v0.1), GQA",
           dict(SMALL_MLP, num_hidden_layers=2, **GQA, sliding_window=WINDOW)),
    Family("gemma2", "google/gemma-2-9b-it",
           f"embeddings scaled by sqrt(D), attention and final logit soft-capping, sliding ({WINDOW}) / global "
           f"layers alternating, query_pre_attn_scalar, tied embeddings",
           _gemma(2, final_logit_softcapping=30.0, attn_logit_softcapping=50.0), embed_rescale=0.05),
    Family("gemma3_text", "google/gemma-3-12b-it (text)",
           f"embeddings scaled by sqrt(D), q/k norms, 3 sliding ({WINDOW}) : 1 global layers, local rope base, "
           f"tied embeddings",
           _gemma(4, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
           embed_rescale=0.05),
    Family("phi3", "microsoft/Phi-4-mini-instruct", "fused qkv and gate/up projections, partial rotary (0.75)",
           dict(SMALL_MLP, num_hidden_layers=2, **GQA, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})),
    Family("mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", "sparse MoE: 4 experts, top-2 routing per token, GQA",
           dict(SMALL_MLP, num_hidden_layers=2, **GQA, num_local_experts=4, num_experts_per_tok=2)),
    Family("qwen3_moe", "Qwen/Qwen3-30B-A3B", "sparse MoE: 4 experts, top-2, normalised top-k, q/k norms",
           dict(SMALL_MLP, num_hidden_layers=2, head_dim=16, **GQA, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=64, norm_topk_prob=True)),
    Family("olmo2", "allenai/OLMo-2-1124-7B-Instruct", "q/k norms over all heads, post-attention / post-MLP norms",
           dict(SMALL_MLP, num_hidden_layers=2, **GQA, pad_token_id=0, eos_token_id=1)),
    Family("gpt_neox", "EleutherAI/pythia-1.4b", "partial rotary (0.25), parallel residual, LayerNorm with bias, "
           "untied embed_out",
           dict(SMALL_MLP, num_hidden_layers=2, num_attention_heads=4, hidden_act="gelu", use_parallel_residual=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
]}


def build_target(model_type: str, seed: int = 0) -> torch.nn.Module:
    if model_type not in FAMILIES:
        raise ValueError(f"no tiny target for model_type={model_type!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[model_type].build(seed)

