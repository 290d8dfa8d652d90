"""P-EAGLE (parallel EAGLE): EAGLE-3's drafter with every draft position of a step predicted in one forward.

Which token each output predicts: depth 0 is EAGLE-3's step 0 (at position t the drafter reads the fused target
features at t and the embedding of token t+1, and predicts token t+2). Depth d >= 1 of the chain anchored at a (the
last context pair: feature at a, token a+1) sits at position a+d, is fed placeholders instead of a feature and a token
(the embedding of ``mask_token_id`` and the learned ``mask_hidden`` in place of the concatenated target features),
and predicts token a+2+d. A decoding step drafts ``depth`` tokens: the new context pairs and the depth-1..K-1 slots go
through the layer together, once; no drafted token is fed back.

Shape legend:  B batch, T sequence, D target hidden size, V target vocabulary, Vd draft vocabulary, F feature layers
(3), K draft depths (``num_depths``), n_d chains sampled at depth d, Q = T + sum(n_d) queries, h heads, hd head size.
    depth 0:   hid = fc([low ; mid ; high]_t),  emb = embed(token t+1),             position t
    depth d:   hid = fc(mask_hidden),            emb = embed(mask_token_id),         position a+d
    x = [input_layernorm(emb) ; hidden_norm(hid)] (2D) -> EAGLE-3's decoder layer (residual hid) -> out_D
    -> norm -> lm_head (D -> Vd) -> logits over the draft vocabulary; ``d2t`` maps them to target ids.
Every piece except ``mask_hidden`` is EAGLE-3's (``heads.eagle.EagleDrafter``, whose layer, fusion, draft vocabulary,
target binding and context cache this class reuses), so the export is EAGLE-3's layout plus ``mask_hidden``. So are
EAGLE-3.1's flags: ``mask_hidden`` goes through fc's norms as the features do (vLLM and speculators feed it through
``combine_hidden_states`` / the same norms); ``norm_output`` changes no output here, since nothing is fed back.

Attention (training, one forward over all Q queries, as SpecForge's P-EAGLE mask, run by ``heads.train_attention``
without a [Q, Q] tensor): a depth-0 query at t sees the
depth-0 keys <= t; a depth-d query of the chain anchored at a sees the depth-0 keys <= a and the keys of depths
1..d of its own chain. That is exactly what the slot sees when decoding (the committed context, then the earlier
slots of the same step). With ``sliding_window`` W, a query at position p (t at depth 0, a + d at depth d) sees only
the depth-0 keys at positions > p - W.

Training data per row (SpecForge's "COD" sampling, nested): depth 0 trains every position; depth d trains the chains
of the first n_d anchors of one random ranking of the row's anchors, n_d = ceil(max(r^d, r_min) x the row's
candidates), so a chain sampled at depth d is sampled at every depth below it (its earlier slots exist as keys). The
ranking is a function of the row's seed (``distill.row_seeds``: run seed, step, the row's index in the step's global
batch), so one process and N ranks, and a resumed run, train the same chains. The deeper depths'
smaller share of the rows is the position weighting SpecForge and speculators train with; ``loss_decay`` ** d
multiplies depth d's term on top (1: none). The divergence is the configured ``loss=`` (EAGLE-3's KL-family menu)
against the target's distribution, through the chunked loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from distill.row_seeds import batch_row_seeds, uniform_bits
from distill.teacher_output import TeacherOutput
from heads import flops
from heads.base import DraftOutput, TargetDims
from heads.eagle.model import EagleDrafter
from heads.layers import DraftLayer, RMSNorm
from heads.peagle.draft import PEagleStaticDraft
from heads.train_attention import StructuredMask, attend, parallel_chain_mask
from inference.sampling import SamplingConfig


class PEagleDrafter(EagleDrafter):
    name = "peagle"
    decode_keys = ("depth",)

    def __init__(self, dims: TargetDims | Mapping[str, int], layers: Sequence[int] | None = None,
                 num_heads: int | None = None, intermediate_size: int | None = None, rope_theta: float = 10000.0,
                 num_depths: int = 8, down_sample_ratio: float = 0.7, down_sample_ratio_min: float = 0.2,
                 loss_decay: float = 1.0, kl_weight: float = 1.0, draft_vocab_size: int | None = None,
                 mask_token_id: int | None = None, depth: int | None = None, num_layers: int = 1,
                 fc_norm: bool = False, norm_before_fc: bool = False, norm_output: bool = False,
                 sliding_window: int | None = None):
        super().__init__(dims, variant="eagle3", layers=layers, num_heads=num_heads,
                         intermediate_size=intermediate_size, rope_theta=rope_theta, ttt_steps=1,
                         loss_decay=loss_decay, kl_weight=kl_weight, draft_vocab_size=draft_vocab_size, tree="chain",
                         fc_norm=fc_norm, norm_before_fc=norm_before_fc, norm_output=norm_output,
                         sliding_window=sliding_window)
        self.name = "peagle"
        V = self.dims.vocab_size
        if num_depths < 1:
            raise ValueError(f"drafter.num_depths={num_depths} must be >= 1 (draft positions predicted per forward)")
        if not 0 < down_sample_ratio <= 1 or not 0 < down_sample_ratio_min <= 1:
            raise ValueError(f"drafter.down_sample_ratio={down_sample_ratio} and drafter.down_sample_ratio_min="
                             f"{down_sample_ratio_min} must be in (0, 1] (depth d trains max(r^d, r_min) of the "
                             f"anchors)")
        mask_token_id = V - 1 if mask_token_id is None else mask_token_id
        if not 0 <= mask_token_id < V:
            raise ValueError(f"drafter.mask_token_id={mask_token_id} is outside the target's vocabulary 0..{V - 1}")
        if depth is not None and not 1 <= depth <= num_depths:
            raise ValueError(f"drafter.depth={depth} must be in 1..num_depths={num_depths} (or null)")
        self.num_depths, self.mask_token_id = num_depths, mask_token_id
        self.down_sample_ratio, self.down_sample_ratio_min = down_sample_ratio, down_sample_ratio_min
        self.depth = depth
        if num_layers < 1:
            raise ValueError(f"drafter.num_layers={num_layers} must be >= 1 (EAGLE-3's layer, then plain ones)")
        layer = self.layer
        # Layers after EAGLE-3's (SpecForge's P-EAGLE stacks plain Llama layers on it), built separately.
        self.upper = nn.ModuleList([UpperLayer(self.dims.hidden_size, layer.num_heads, layer.gate_proj.out_features,
                                               layer.theta) for _ in range(num_layers - 1)])
        # The placeholder for the target features at depths >= 1, in fc's input space ([F*D], as the engines load it).
        self.mask_hidden = nn.Parameter(torch.randn(self.fc.in_features))

    def saved_config(self, drafter_cfg: Mapping[str, Any]) -> dict:
        node = super().saved_config(drafter_cfg)
        node["mask_token_id"] = self.mask_token_id  # resolved, so a load never re-derives them
        node["draft_vocab_size"] = self.draft_vocab_size
        node["num_layers"] = 1 + len(self.upper)
        return node

    def set_tree(self, spec) -> None:
        if spec is not None and spec != "chain":
            raise ValueError(f"decoder.tree={spec!r}: drafter {self.name!r} drafts a chain (all depths in one "
                             f"forward); set decoder.tree=null")
        self.tree_mode = "chain"

    @property
    def dense_teacher_logits(self) -> bool:
        """Depths > 0 re-read teacher rows that depth 0 reads: keep them dense over a full vocabulary, as EAGLE-3's
        training-time test does; a reduced vocabulary reads its slice."""
        return self.draft_vocab_size == self.dims.vocab_size and self.num_depths > 1

    # --- training ------------------------------------------------------------------------------------------
    def train_flops(self, target, B: int, T: int):
        return flops.peagle(self, target, B, T)

    def _ratios(self) -> list[float]:
        return [max(self.down_sample_ratio ** d, self.down_sample_ratio_min) for d in range(1, self.num_depths)]

    def depth_counts(self, candidates: int) -> list[int]:
        """Chains trained at depths 1..K-1 out of ``candidates`` anchors: non-increasing, so the sets nest."""
        return [min(candidates, math.ceil(r * candidates)) for r in self._ratios()]

    def _rank_anchors(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, list[int]]:
        """(anchors [B, N], taken [B, K-1], [N_1, ..., N_{K-1}]): each row's anchors (positions whose depth-1 slot is
        trainable) in one random order, a function of the row's seed (``distill.row_seeds``); row b trains the
        chains of its first ``taken[b, d-1]`` anchors at depth d (``depth_counts`` of its own anchors, computed on
        the device); N_d, ``depth_counts`` of the most anchors a row of length T can have (T - 3), sizes the dense
        queries: static shapes, no read-back. A top-k ranking of a larger k has the smaller k's picks as its
        prefix, so the chains a row trains do not depend on N_d."""
        cand = self.train_mask(batch, 1)
        B, T = cand.shape
        counts = self.depth_counts(max(T - 3, 0))
        c = cand.sum(1, keepdim=True).double()  # float64: ceil(r * c) as math.ceil computes it
        taken = (torch.cat([torch.minimum(torch.ceil(c * r), c) for r in self._ratios()], 1).long() if counts
                 else cand.new_zeros((B, 0), dtype=torch.long))
        if not counts or counts[0] == 0:
            return cand.new_zeros((cand.shape[0], 0), dtype=torch.long), taken, [0] * len(counts)
        score = uniform_bits(batch_row_seeds(batch), cand.shape[1]).masked_fill(~cand, -1)
        return score.topk(counts[0], dim=1).indices, taken, counts

    def compile_regions(self) -> list[tuple[object, str]]:
        """EAGLE-3's (the fused input, the first layer's projections and its MLP half) and each stacked layer
        whole."""
        return [*super().compile_regions(), *((upper, "forward") for upper in self.upper)]

    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput, loss_fn=None) -> DraftOutput:
        ids, attn = batch["input_ids"], batch["attention_mask"].bool()
        B, T = ids.shape
        if T < 3:
            raise ValueError(f"data.max_length={T} is too short for {self.name}; it needs at least 3 tokens per row")
        feats = torch.cat([teacher_out.hidden[i] for i in self.teacher_layers], -1)
        dtype = self.fc.weight.dtype if not torch.is_autocast_enabled(feats.device.type) else feats.dtype
        feats = feats.to(dtype)
        anchors, taken, counts = self._rank_anchors(batch)
        dev = ids.device
        # queries: [depth 0 at every position | depth 1 chains | depth 2 chains | ...]
        hid0 = self._first_hidden(feats)
        emb0 = self._embed(torch.roll(ids, -1, dims=1), hid0)
        slots = sum(counts)
        hid_m = self._first_hidden(self.mask_hidden.to(dtype)).expand(B, slots, -1)  # as vLLM: through fc's norms
        emb_m = self._embed(torch.full((B, slots), self.mask_token_id, dtype=torch.long, device=dev), hid0)
        x, residual = self._layer_input(torch.cat([emb0, emb_m], 1), torch.cat([hid0, hid_m], 1))
        slot_anchor = torch.cat([anchors[:, :n] for n in counts], 1) if slots else anchors[:, :0]  # [B, slots]
        slot_depth = torch.cat([torch.full((n,), d + 1, device=dev) for d, n in enumerate(counts)]) if slots \
            else torch.zeros(0, dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(T, device=dev).expand(B, T), slot_anchor + slot_depth], 1)
        q, k, v = self.layer.qkv(x, pos)
        # Training rows are right-padded (distill.data): depth 0 is plain causal attention at every real query.
        mask = parallel_chain_mask(attn, anchors, counts, window=self.sliding_window)
        out = self.layer.finish(attend(q, k, v, mask), residual)
        for upper in self.upper:
            out = upper(out, pos, mask)
        out = self._output(out)
        terms = [self._step_loss(out[:, :T], teacher_out, feats, self.train_mask(batch, 0), 0)[0]]
        start = T
        for d, n in enumerate(counts, start=1):
            if n == 0:
                break
            # Every chain slot is a row (in its anchor's position order), weighted by whether row b takes it (its
            # first taken[b] chains) and its token is loss-bearing: EAGLE-3's step term, static shapes, no sync.
            a_Bn, order = anchors[:, :n].sort(1)
            rows = (order < taken[:, d - 1: d]) & self.train_mask(batch, d).gather(1, a_Bn)
            out_Bn = out[:, start: start + n].gather(1, order[..., None].expand(-1, -1, out.shape[-1]))
            b_N = torch.arange(B, device=dev)[:, None].expand(B, n).reshape(-1)
            t_N = (a_Bn + 1 + d).clamp(max=T - 1).reshape(-1)  # step d at a is compared with the teacher at a+1+d
            terms.append(self._term(out_Bn.reshape(B * n, -1), teacher_out, b_N, t_N, rows.reshape(-1).float(), d))
            start += n
        return DraftOutput(terms=terms, num_valid=self.count_valid(batch)).evaluate(loss_fn)

    # --- decoding ------------------------------------------------------------------------------------------
    def static_draft(self, committed, capacity: int, sampling: SamplingConfig, generator):
        """The catch-up and the whole chain as one capture-safe step (``heads.peagle.draft``), drafting ``depth``
        tokens, at most as many as the committed buffers allow (their rows - 1) and ``num_depths``."""
        rows = committed.ids_M.shape[0]
        depth = min(self.depth or self.num_depths, rows - 1, self.num_depths)
        # keyed by the weights' dtype too: its buffers are allocated in it (eval times each candidate dtype)
        return self.reuse_static_draft((depth, self.fc.weight.dtype), committed, capacity, sampling, generator,
                                       lambda: PEagleStaticDraft(self, committed, capacity, depth, sampling,
                                                                 generator))


class UpperLayer(nn.Module):
    """A plain Llama decoder layer stacked on EAGLE-3's: input norm, then ``heads.layers.DraftLayer``'s attention
    (the caller's mask) and MLP, residual around both."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, theta: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps=1e-6)
        self.layer = DraftLayer(hidden_size, hidden_size, num_heads, intermediate_size, theta)

    def forward(self, h_BTD: Tensor, positions: Tensor, mask: StructuredMask) -> Tensor:
        """The whole layer over ``h_BTD`` under ``mask`` (``heads.train_attention``), as training runs it: a call of
        the module itself, so an engine that gathers a sharded block's weights on its forward (FSDP2) sees it."""
        q, k, v = self.qkv(h_BTD, positions)
        return self.finish(attend(q, k, v, mask), h_BTD)

    def qkv(self, h_BTD: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.layer.qkv(self.input_layernorm(h_BTD), positions)

    def qkv_rotated(self, h_BTD: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.layer.qkv_rotated(self.input_layernorm(h_BTD), cos, sin)

    def finish(self, attn_BhTd: Tensor, residual_BTD: Tensor) -> Tensor:
        return self.layer.finish(attn_BhTd, residual_BTD)
