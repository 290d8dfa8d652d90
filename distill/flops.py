"""FLOPs of one training micro-batch from shapes alone: the pieces every drafter's count is built from.

Nothing here runs a model or reads a tensor's values: a count is a function of the sizes of the frozen target (read
once from its modules and config), of the drafter, and of the micro-batch's [B, T]. A multiply-add is 2 FLOPs.

Two conventions differ only in attention (``Flops``):
    dense   every attention call's whole [queries x keys] score matrix as the kernel is given it, its backward 2.5x
            its forward (the score recompute of flash kernels + 4 products): what ``torch.utils.flop_counter``
            counts for scaled_dot_product_attention, whatever the mask.
    model   only the (query, key) pairs the mask allows (causal: half), backward 2x: the work the model needs, the
            figure MFU is quoted in (PaLM's convention), so a better kernel (skipping masked blocks) shows as a
            higher MFU instead of the same one.
Linear layers are the same under both: forward 1x; backward adds 1x for the input's gradient where the input needs
one and 1x for the weight's gradient where the weight trains (a frozen layer on the gradient's way, EAGLE-1's use of
the target's lm_head or Medusa-2's base weights, costs 1x; a trainable layer reading a frozen input, 1x).
Not counted: elementwise work (norms, rotary, softmax, the loss itself), activation recomputation, and the one-off
probes a teacher runs on its first batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Callable

from torch import nn

ATTN_BACKWARD_DENSE = 2.5  # torch.utils.flop_counter's SDPA backward: the scores again + 4 products (forward: 2)
ATTN_BACKWARD_MODEL = 2.0  # the gradients' 4 products, no recompute
# Projections that read a decoder layer's own input: in layer 0 of a target whose embedding is frozen that input needs
# no gradient, so these projections skip their input-gradient product (Medusa-2's LoRA-adapted target). Matched by the
# attention projections' names; a parallel-residual MLP reading the same input (GPT-NeoX) is counted with its product.
INPUT_PROJECTIONS = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|query_key_value|W_pack|c_attn)(\.|$)")


@dataclass(frozen=True)
class Flops:
    """FLOPs of some work: ``linear`` (matmuls of weights: the same in both conventions) plus attention under each."""

    linear: float = 0.0
    attn_dense: float = 0.0
    attn_model: float = 0.0

    @property
    def dense(self) -> float:
        return self.linear + self.attn_dense

    @property
    def model(self) -> float:
        return self.linear + self.attn_model

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, k: float) -> "Flops":
        return Flops(*(getattr(self, f.name) * k for f in fields(self)))

    __rmul__ = __mul__


@dataclass(frozen=True)
class StepFlops:
    """One micro-batch's FLOPs: what the frozen target computes for the teacher signal (its forward and read-out
    projections of teacher rows) and everything else (drafter forward and backward, its loss heads, any pass through
    the target that trains, e.g. Medusa-2's adapted target)."""

    teacher: Flops
    drafter: Flops

    @property
    def total(self) -> Flops:
        return self.teacher + self.drafter


def total(parts) -> Flops:
    out = Flops()
    for p in parts:
        out = out + p
    return out


def matmul(rows: float, n_in: int, n_out: int, grad_input: bool = False, grad_weight: bool = False) -> Flops:
    """A [rows, n_in] x [n_in, n_out] product, plus the backward products asked for (each as large)."""
    return Flops(linear=2.0 * rows * n_in * n_out * (1 + grad_input + grad_weight))


def attention(batch: float, heads: int, queries: float, keys: float, head_dim: int, pairs: float,
              backward: bool = True) -> Flops:
    """One attention call over ``queries`` x ``keys`` (dense) of which ``pairs`` per (row, head) the mask allows
    (model): q.k and p.v, one multiply-add per head dimension each."""
    per_pair = 4.0 * head_dim * batch * heads
    return Flops(attn_dense=per_pair * queries * keys * (1 + ATTN_BACKWARD_DENSE * backward),
                 attn_model=per_pair * pairs * (1 + ATTN_BACKWARD_MODEL * backward))


def causal_pairs(T: int, window: int | None = None) -> float:
    """Allowed (query, key) pairs of a causal [T, T] mask (each query sees itself), within ``window`` keys if given."""
    if window is None or window >= T:
        return T * (T + 1) / 2
    return window * (window + 1) / 2 + (T - window) * window


@dataclass(frozen=True)
class Weight:
    """One matmul weight of a decoder layer: its path in the layer, the elements a token goes through (an expert bank
    [E, out, in]: top_k / E of it), whether it trains, and whether it reads the layer's own input."""

    name: str
    per_token: float
    trainable: bool
    reads_input: bool


@dataclass(frozen=True)
class LMShape:
    """What a Hugging Face decoder LM's FLOPs depend on, read once from its modules and config: hidden size,
    vocabulary, attention heads and head size, and every decoder layer's matmul weights (any parameter of 2 or more
    dimensions: fused or split projections, gated or plain MLPs and MoE expert banks alike)."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    layers: tuple[tuple[Weight, ...], ...]
    windows: tuple[int | None, ...]  # per layer: its sliding window (model convention), None for full attention
    embedding_trainable: bool
    head_trainable: bool

    @classmethod
    def of(cls, model: nn.Module) -> "LMShape":
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        top_k = getattr(config, "num_experts_per_tok", None) or 1
        layer_types = getattr(config, "layer_types", None) or ()
        window = getattr(config, "sliding_window", None)
        layers = []
        for module in _decoder_layers(model, config.num_hidden_layers):
            weights = []
            for name, p in module.named_parameters():
                if p.dim() < 2:
                    continue
                per_token = p.numel() * (top_k / p.shape[0] if p.dim() == 3 else 1)  # an expert bank: top_k of E
                # a LoRA B reads its A's output (which needs a gradient), not the layer input
                reads = bool(INPUT_PROJECTIONS.search(name)) and "lora_B" not in name
                weights.append(Weight(name, float(per_token), p.requires_grad, reads))
            layers.append(tuple(weights))
        windows = tuple(window if i < len(layer_types) and layer_types[i] == "sliding_attention" else None
                        for i in range(len(layers)))
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        return cls(config.hidden_size, head.weight.shape[0], heads, head_dim, tuple(layers), windows,
                   embed.weight.requires_grad, head.weight.requires_grad)

    def forward(self, B: int, T: int, adapters: bool = False) -> Flops:
        """A frozen forward of every decoder layer (``adapters``: with any LoRA weights inside, else without them)."""
        per_token = sum(w.per_token for layer in self.layers for w in layer if adapters or "lora_" not in w.name)
        return Flops(linear=2.0 * B * T * per_token) + self._attention(B, T, backward=False)

    def train(self, B: int, T: int) -> Flops:
        """Forward and backward of every decoder layer, gradients flowing back to the embedding: each weight's
        input gradient (except layer 0's input projections when the embedding is frozen: their input needs none) and
        the weight gradients of the trainable ones."""
        out = Flops()
        for i, layer in enumerate(self.layers):
            for w in layer:
                grad_input = not (i == 0 and w.reads_input and not self.embedding_trainable)
                out = out + Flops(linear=2.0 * B * T * w.per_token * (1 + grad_input + w.trainable))
        return out + self._attention(B, T, backward=True)

    def lm_head(self, rows: float, grad_input: bool = False, grad_weight: bool = False) -> Flops:
        return matmul(rows, self.hidden_size, self.vocab_size, grad_input, grad_weight)

    def _attention(self, B: int, T: int, backward: bool) -> Flops:
        return total(attention(B, self.num_heads, T, T, self.head_dim, causal_pairs(T, w), backward)
                     for w in self.windows)


def _decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder layers: the first ModuleList of ``num_hidden_layers`` modules (``model.layers`` in most families,
    ``gpt_neox.layers`` in GPT-NeoX)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"{type(model).__name__}: no ModuleList of its {num_layers} decoder layers to count FLOPs over")


@dataclass(frozen=True)
class TargetShape:
    """The frozen target as FLOP counts see it: its ``LMShape`` and how it answers ``signals``: ``online`` (a forward
    per batch; False for an offline cache, ``distill.cache``, which answers from disk) and whether it can give the
    projected form (``Teacher(dense=False)``: logits of the last position only, each loss chunk projecting its rows),
    asked only for a drafter that wants that form: the teacher answers it with a one-off probe forward, which it runs
    on that drafter's first batch anyway."""

    lm: LMShape
    online: bool
    can_project: Callable[[], bool]

    @classmethod
    def of(cls, teacher) -> "TargetShape":
        from distill.teacher import Teacher  # the same layer; imported here to keep this module free of models

        online = isinstance(teacher, Teacher)
        return cls(LMShape.of(teacher.model), online, (lambda: teacher._can_project) if online else (lambda: False))

    def form(self, dense: bool) -> str:
        """The signal form a drafter asking ``dense`` gets: dense | projected | sparse (offline top-K)."""
        if not self.online:
            return "sparse"
        return "projected" if not dense and self.can_project() else "dense"

    def signals(self, B: int, T: int, form: str, projected_rows: float = 0.0) -> Flops:
        """The teacher's FLOPs for one batch: the forward with its logits (every position when dense, the last one when
        projected: ``logits_to_keep=1``) plus ``projected_rows`` read-out projections done by the loss."""
        if form == "sparse":
            return Flops()
        logits = B * T if form == "dense" else B
        return self.lm.forward(B, T) + self.lm.lm_head(logits + (projected_rows if form == "projected" else 0))


def projected_rows(B: int, T: int, term_rows: list[float], covered: float, sliced: bool = False) -> float:
    """Read-out projections of a projected teacher (``distill.teacher_output``): a vocabulary slice (a reduced draft
    vocabulary) projects every row once; otherwise each term projects its own rows in its loss chunks, and the
    agreement labels then project every row no term covered (``covered``: rows projected at least once)."""
    if sliced:
        return float(B * T)
    return float(sum(term_rows)) + max(0.0, B * T - covered)
