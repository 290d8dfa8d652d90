"""EAGLE-1 and EAGLE-3 feature drafters: one small decoder layer that runs on the target's hidden states.

Which token each output predicts: at position t the drafter reads the target's feature(s) at t and the embedding of
token t+1, and predicts token t+2 (one beyond the target's own lm_head at t). Training-time test step j feeds its own
step j-1 output back in place of the feature, with the embedding of token t+1+j, and predicts token t+2+j.

Shape legend:  B batch, T sequence, D target hidden size, V target vocabulary, Vd draft vocabulary (EAGLE-3's
reduced vocabulary; = V for EAGLE-1), F number of feature layers (EAGLE-1: 1; EAGLE-3: 3), S TTT steps, h heads.
    EAGLE-1:  x = fc([emb_BTD ; feat_BTD])  (2D -> D, no bias)     -> layer(x, residual x; no input norm) -> out_BTD
              (a predicted feature) -> the target's frozen lm_head -> logits_BTV. This is the architecture vLLM,
              SGLang and SafeAILab/EAGLE run (``EagleLlamaForCausalLM``: embedding first, layer 0's input_layernorm an
              identity), so an export is the trained drafter exactly.
    EAGLE-3:  hid = fc([low ; mid ; high])  (3D -> D)  or step j-1's out
              x = [norm(emb) ; norm(hid)]   (2D)                    -> layer(x, residual hid) -> out_BTD
              -> norm -> own lm_head (D -> Vd) -> logits over the draft vocabulary; ``d2t`` maps them to target ids
    EAGLE-3.1 (flags, off by default; the names vLLM, speculators, SpecForge and NeMo use):
              ``fc_norm``         fc([norm_low(low) ; norm_mid(mid) ; norm_high(high)]): one RMSNorm per feature layer
              ``norm_before_fc``  fc(norm([low ; mid ; high])): one RMSNorm over the concatenation (not with fc_norm)
              ``norm_output``     out = norm(layer(...)): the post-norm state is both the next step's hid and the
                                  lm_head's input (plain EAGLE-3 feeds the pre-norm state back and norms only for
                                  the lm_head)
    ``sliding_window`` W: a query at position p sees the context pairs at positions p - W + 1 .. p only (training
    and every decoding path alike; a draft node always sees its own ancestors, as engines do while depth < W).

Feature layers use ``distill.teacher``'s hidden-state index: index i is HF ``hidden_states[i]``, the output of
decoder layer i (1-based) = the *input* of 0-based layer i, which is also the number vLLM's
``eagle_aux_hidden_state_layer_ids`` uses (SGLang's is i - 1: see serve/eagle.py); -1 (EAGLE-1's default) is
the final, normed output the lm_head reads.

Training-time test (EAGLE-3; also available to EAGLE-1 via ``ttt_steps``): step j at position t attends to the
step-0 keys of positions <= t plus the keys of steps 1..j at position t itself, which is exactly what a depth-(j+1)
draft node sees when decoding (the committed context plus its own ancestors); its loss weight is ``decay ** j``.

Decoding: context pairs (target feature at t, token t+1) only ever come from committed tokens, so the drafter's
context KV cache only grows (cropped to the common prefix if asked to re-propose an earlier context); draft nodes
keep their own temporary keys. Proposals are EAGLE-2 dynamic trees (``inference.dynamic_tree``) or a top-1 chain
(``tree: chain``); candidates are top-k picks, so they carry no draft probabilities and sampling stays lossless.
The decoder drafts through ``static_draft`` (``heads.eagle.draft``): the catch-up and every level as one
capture-safe step over buffers allocated once, at every row of a batch. The eager one-sequence proposal it is tested
against is the tests' reference (tests/eager_reference.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill.chunked import Finished, Frozen, TeacherRows, slice_positions
from distill.teacher_output import TeacherOutput
from heads.base import Drafter, DraftOutput, DraftTerm, TargetDims
from heads import flops
from heads.eagle.draft import EagleStaticDraft
from heads.eagle.attention import EXPLICIT_ATTENTION_ELEMENTS, EXPLICIT_MAX_SEQ, explicit_ttt_attention
from heads.eagle.variants import TREE_MODES, VARIANTS, check_eagle31, default_feature_layers
from heads.layers import DraftLayer, RMSNorm, vocab_maps
from heads.train_attention import StructuredMask, attend, chosen, ttt_step_mask
from inference.dynamic_tree import check_dynamic_tree_args
from inference.sampling import SamplingConfig

log = logging.getLogger(__name__)

class EagleDrafter(Drafter):
    def __init__(self, dims: TargetDims | Mapping[str, int], variant: str = "eagle3", layers: Sequence[int] | None = None,
                 num_heads: int | None = None, intermediate_size: int | None = None, rope_theta: float = 10000.0,
                 ttt_steps: int | None = None, loss_decay: float = 0.8, feature_loss_weight: float | None = None,
                 kl_weight: float | None = None, feature_noise: float = 0.0, draft_vocab_size: int | None = None,
                 tree: str = "dynamic", top_k: int = 4, depth: int | None = None, total_tokens: int = 16,
                 checkpoint_layer: bool = False, ttt_warmup_steps: int = 0, fc_norm: bool = False,
                 norm_before_fc: bool = False, norm_output: bool = False, sliding_window: int | None = None):
        super().__init__(dims)
        self.checkpoint_layer = bool(checkpoint_layer)  # recompute each TTT step's layer in backward (less memory)
        D, V, L = self.dims.hidden_size, self.dims.vocab_size, self.dims.num_layers
        if variant not in VARIANTS:
            raise ValueError(f"drafter.variant={variant!r} is not known; valid: {list(VARIANTS)}")
        self.variant, self.name = variant, variant
        eagle3 = variant == "eagle3"
        layers = tuple(default_feature_layers(variant, L) if layers is None else layers)
        for i in layers:
            if not (-1 <= i <= L):
                raise ValueError(
                    f"drafter.layers contains {i}, out of range for a target with {L} layers; valid hidden-state "
                    f"indices are 0..{L} (i = output of decoder layer i, {L} = final normed output) or -1 (= {L})")
        if len(layers) != (3 if eagle3 else 1):
            raise ValueError(f"drafter.layers={list(layers)}: {variant} reads {3 if eagle3 else 1} feature layer(s)")
        self.teacher_layers = layers
        self.ttt_steps = ttt_steps if ttt_steps is not None else (7 if eagle3 else 1)
        self.feature_loss_weight = feature_loss_weight if feature_loss_weight is not None else (0.0 if eagle3 else 1.0)
        self.kl_weight = kl_weight if kl_weight is not None else (1.0 if eagle3 else 0.1)
        if self.ttt_steps < 1:
            raise ValueError(f"drafter.ttt_steps must be >= 1, got {self.ttt_steps}")
        if ttt_warmup_steps < 0:
            raise ValueError(f"drafter.ttt_warmup_steps must be >= 0 (optimizer steps trained without training-time "
                             f"test before ttt_steps start), got {ttt_warmup_steps}")
        self.ttt_warmup_steps = int(ttt_warmup_steps)
        self._ttt_now = self.ttt_steps  # steps unrolled by forward: 1 during the warm-up (``begin_step``)
        check_dynamic_tree_args(top_k, depth or 1, total_tokens)
        if not 0 < loss_decay <= 1:
            raise ValueError(f"drafter.loss_decay must be in (0, 1], got {loss_decay}")
        if feature_noise < 0:
            raise ValueError(f"drafter.feature_noise must be >= 0, got {feature_noise}")
        Vd = V if draft_vocab_size is None else draft_vocab_size
        if Vd < 1:
            raise ValueError(f"drafter.draft_vocab_size={draft_vocab_size} must be >= 1 (null uses the full vocabulary)")
        if eagle3 and Vd > V:  # a preset written for 128k-token targets, run on a small one (experiment=smoke)
            log.warning("drafter.draft_vocab_size=%d exceeds the target's vocab_size %d: drafting over the full "
                        "vocabulary", Vd, V)
            Vd = V
        if not eagle3 and Vd != V:
            raise ValueError("drafter.draft_vocab_size is an EAGLE-3 feature; eagle1 drafts over the target's lm_head")
        self.loss_decay, self.feature_noise, self.draft_vocab_size = loss_decay, feature_noise, Vd
        check_eagle31(variant, fc_norm, norm_before_fc, norm_output, sliding_window)
        self.fc_norm_on, self.norm_before_fc, self.norm_output = bool(fc_norm), bool(norm_before_fc), bool(norm_output)
        self.sliding_window = sliding_window
        heads = num_heads or max(1, D // 64)
        inter = intermediate_size or 64 * math.ceil(8 * D / 3 / 64)
        # Bias-free fc for both variants: the engines' EAGLE-1 and EAGLE-3 fc has no bias in vLLM (SGLang's EAGLE-1
        # fc has one; its export writes zeros), so every trained parameter has a home in every engine.
        self.fc = nn.Linear(len(layers) * D if eagle3 else 2 * D, D, bias=False)
        self.layer = DraftLayer(2 * D if eagle3 else D, D, heads, inter, rope_theta)
        if eagle3:
            self.input_layernorm = RMSNorm(D, eps=1e-6)  # the embedding half of the layer input
            self.hidden_norm = RMSNorm(D, eps=1e-6)
            self.norm = RMSNorm(D, eps=1e-6)
            self.lm_head = nn.Linear(D, Vd, bias=False)
            if fc_norm:  # state keys fc_norm.{i}.weight: the engines' names (vLLM: model.fc_norm.{i}.weight)
                self.fc_norm = nn.ModuleList([RMSNorm(D, eps=1e-6) for _ in layers])
            if norm_before_fc:  # input_norm.weight: vLLM's and speculators' name for it
                self.input_norm = RMSNorm(len(layers) * D, eps=1e-6)
        # Vocabulary maps are buffers: they are part of the trained drafter and saved with it.
        self.register_buffer("d2t", torch.arange(Vd), persistent=True)
        self.register_buffer("t2d", torch.arange(V) if Vd == V else torch.full((V,), -1), persistent=True)
        self.tree_mode = "dynamic"
        self.set_tree(tree)
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self._frozen: dict[str, nn.Module] = {}  # the target's embedding / lm_head: used, never owned or saved
        self.reset()

    # --- binding to the target ----------------------------------------------------------------------------
    def bind_target(self, teacher, initialize: bool) -> None:
        for i in self.teacher_layers:
            teacher.resolve_layer(i)
        # The target's read-outs as its forward computes them (embedding scale, final logit soft-capping).
        self._frozen = {"embed": teacher.input_embedding, "lm_head": teacher.output_logits}
        if initialize and self.variant == "eagle3":
            self._init_from_target(teacher)

    @torch.no_grad()
    def _init_from_target(self, teacher) -> None:
        """Start EAGLE-3 where the target ends: ``fc`` passes the highest feature layer through (the others start at
        zero), the output norm is the target's final norm and the draft lm_head its rows of the draft vocabulary, so
        step 0 begins as "the target's own prediction from its layer-``high`` state" instead of noise. (The EAGLE-3
        reference initialises fc at random. On the toy target the two starts measured alike: top-1 0.33 vs 0.33 after
        60 equal steps; this one is kept because it makes an untrained drafter's proposals meaningful.)"""
        D = self.dims.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -D:].copy_(torch.eye(D))
        gain = teacher.final_norm_gain  # read through the norm: Gemma's is 1 + weight, not weight
        if gain is not None and gain.shape == self.norm.weight.shape:
            self.norm.weight.copy_(gain.to(self.norm.weight))
        self._init_lm_head()

    def prepare(self, dataset) -> None:
        """EAGLE-3 with a reduced vocabulary: keep the most frequent predicted tokens of the training data."""
        if self.draft_vocab_size == self.dims.vocab_size:
            return
        ids, mask = dataset.input_ids, dataset.loss_mask.bool() & dataset.attention_mask.bool()
        counts = torch.bincount(ids[mask].reshape(-1), minlength=self.dims.vocab_size)[: self.dims.vocab_size]
        d2t, t2d = vocab_maps(counts, self.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        covered = counts[d2t].sum().item() / max(1, counts.sum().item())
        log.info("draft vocabulary: %d of %d tokens, covering %.1f%% of the training tokens",
                 self.draft_vocab_size, self.dims.vocab_size, 100 * covered)
        self._init_lm_head()

    def _init_lm_head(self) -> None:
        if "lm_head" in self._frozen:  # start from the target's rows of the draft vocabulary
            weight = self._frozen["lm_head"].weight.detach()
            self.lm_head.weight.data.copy_(weight[self.d2t.to(weight.device)].to(self.lm_head.weight))

    def saved_config(self, drafter_cfg: Mapping[str, Any]) -> dict:
        node = dict(drafter_cfg)
        node["layers"] = list(self.teacher_layers)  # resolved defaults, so a load never re-derives them
        return node

    def set_tree(self, spec) -> None:
        if spec is None:
            return
        if spec not in TREE_MODES:
            raise ValueError(f"tree={spec!r} for {self.name}: valid: {list(TREE_MODES)} (dynamic: EAGLE-2 dynamic "
                             f"tree sized by drafter.top_k / depth / total_tokens; chain: top-1 chain)")
        self.tree_mode = spec

    @property
    def dense_teacher_logits(self) -> bool:
        """Only several TTT steps over the full vocabulary re-read full teacher rows; a reduced vocabulary reads its
        slice (``TeacherOutput.columns``, kept once per batch), one step its rows once."""
        return self.draft_vocab_size == self.dims.vocab_size and self._ttt_now > 1

    def begin_step(self, step: int) -> None:
        """``ttt_warmup_steps``: optimizer steps before it unroll step 0 only (no training-time test, the cheap step
        of EAGLE-1's cost), later ones all ``ttt_steps``."""
        self._ttt_now = 1 if step < self.ttt_warmup_steps else self.ttt_steps

    def train_flops(self, target, B: int, T: int):
        return flops.eagle(self, target, B, T)

    @property
    def flops_stage(self) -> tuple:
        return (self._ttt_now,)

    @property
    def dynamic_tree(self) -> bool:
        """Whether proposals are EAGLE-2 dynamic trees (whose shape the static cost model cannot predict)."""
        return self.tree_mode == "dynamic"

    def _embed(self, ids: Tensor, like: Tensor) -> Tensor:
        if "embed" not in self._frozen:
            raise RuntimeError(f"{self.name} is not bound to a target; call bind_target(teacher, ...) first")
        return self._frozen["embed"](ids.to(self._frozen["embed"].weight.device)).to(like.device, like.dtype)

    def _logits(self, out_BTD: Tensor) -> Tensor:
        """Logits over the draft vocabulary (EAGLE-1: the target's lm_head, frozen)."""
        target = self._frozen.get("lm_head")  # distill.teacher.TargetLogits: lm_head + what the forward does after it
        if self.variant == "eagle3":
            raw = self.lm_head(out_BTD if self.norm_output else self.norm(out_BTD))  # norm_output: normed already
            return raw if target is None else target.finish(raw)
        return target(out_BTD.to(target.weight.dtype)).to(out_BTD.dtype)

    def _vocab_projection(self, out_ND: Tensor) -> tuple[Tensor, Any]:
        """(features, head) with ``head(features) == self._logits(out_ND)``: the loss applies the head in chunks."""
        target = self._frozen.get("lm_head")  # distill.teacher.TargetLogits (soft-capping included)
        if self.variant == "eagle3":
            capped = target is not None and target.softcap is not None
            features = out_ND if self.norm_output else self.norm(out_ND)
            return features, Finished(self.lm_head, target.finish) if capped else self.lm_head
        return out_ND, Frozen(target)  # no gradient for the target's lm_head

    def _layer_input(self, emb_BTD: Tensor, hid_BTD: Tensor) -> tuple[Tensor, Tensor]:
        """(attention input, residual) for one step."""
        if self.variant == "eagle3":
            return torch.cat([self.input_layernorm(emb_BTD), self.hidden_norm(hid_BTD)], -1), hid_BTD
        x = self.fc(torch.cat([emb_BTD, hid_BTD], -1))  # EAGLE-1's layer 0 has no input norm (the engines' identity)
        return x, x

    def _first_hidden(self, feats_BTX: Tensor) -> Tensor:
        """Step 0's hidden input from the concatenated target features (EAGLE-3: fc, after ``fc_norm`` or
        ``norm_before_fc`` when set; EAGLE-1: the feature itself)."""
        if self.variant != "eagle3":
            return feats_BTX
        if self.fc_norm_on:
            chunks = feats_BTX.chunk(len(self.fc_norm), -1)
            feats_BTX = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], -1)
        elif self.norm_before_fc:
            feats_BTX = self.input_norm(feats_BTX)
        return self.fc(feats_BTX)

    def _output(self, out_BTD: Tensor) -> Tensor:
        """A step's output as the next step and the lm_head read it: ``norm_output`` makes it the post-norm state."""
        return self.norm(out_BTD) if self.norm_output else out_BTD

    def _finish(self, attn_BhTd: Tensor, residual_BTD: Tensor) -> Tensor:
        """The layer's MLP half after attention, then ``_output``."""
        return self._output(self.layer.finish(attn_BhTd, residual_BTD))

    def window_mask(self, query_pos: Tensor, key_pos: Tensor) -> Tensor | None:
        """Broadcast bool ``query_pos - key_pos < sliding_window`` (the context keys a query may see), or None
        without a window."""
        if self.sliding_window is None:
            return None
        return (query_pos - key_pos) < self.sliding_window

    # --- training ------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput, loss_fn=None) -> DraftOutput:
        ids_BT, attn_BT = batch["input_ids"], batch["attention_mask"].bool()
        feats = torch.cat([teacher_out.hidden[i] for i in self.teacher_layers], -1)
        dtype = self.fc.weight.dtype if not torch.is_autocast_enabled(feats.device.type) else feats.dtype
        feats = feats.to(dtype)
        noisy = feats
        if self.training and self.feature_noise > 0:  # EAGLE-1: robustness to its own imperfect features
            noisy = feats + (torch.rand_like(feats) * 2 - 1) * self.feature_noise
        T = ids_BT.shape[1]
        pos = torch.arange(T, device=ids_BT.device)
        hid = self._first_hidden(noisy)
        keys: list[tuple[Tensor, Tensor]] = []  # per step: (k, v) [B, h, T, hd]
        terms, aux = [], None
        for j in range(self._ttt_now):
            n = T - 2 - j  # positions t with a predicted token t+2+j inside the row
            if n <= 0:
                break
            emb = self._embed(torch.roll(ids_BT, -(1 + j), dims=1), hid)  # token t+1+j at position t
            # Training rows are right-padded (distill.data): step 0 is plain causal attention at every real query.
            mask = ttt_step_mask(attn_BT, j, window=self.sliding_window)
            step = (emb, hid, pos + j, mask, *(t for kv in keys for t in kv))
            if self.checkpoint_layer and torch.is_grad_enabled():
                out, k, v = torch.utils.checkpoint.checkpoint(self._ttt_step, *step, use_reentrant=False)
            else:
                out, k, v = self._ttt_step(*step)
            keys.append((k, v))
            mask_BT = self.train_mask(batch, j)
            term, feat_loss = self._step_loss(out, teacher_out, feats, mask_BT, j)
            terms.append(term)
            if feat_loss is not None:
                aux = feat_loss if aux is None else aux + feat_loss
            hid = out
        if not terms:
            raise ValueError(f"data.max_length={T} is too short for {self.name}; it needs at least 3 tokens per row")
        return DraftOutput(terms=terms, num_valid=self.count_valid(batch), aux_loss_sum=aux).evaluate(loss_fn)

    def _ttt_step(self, emb: Tensor, hid: Tensor, pos_T: Tensor, mask: StructuredMask, *prev: Tensor
                  ) -> tuple[Tensor, ...]:
        """One training-time-test step: (output, its keys, its values); ``prev`` = earlier steps' k0, v0, k1, v1..."""
        x, residual = self._layer_input(emb, hid)
        q, k, v = self.layer.qkv(x, pos_T)
        keys = [(prev[i], prev[i + 1]) for i in range(0, len(prev), 2)] + [(k, v)]
        return self._finish(self._ttt_attention(q, keys, mask), residual), k, v

    def compile_regions(self) -> list[tuple[object, str]]:
        """The fused input, the layer's projections and its MLP half: the same shapes at every TTT step, so one
        graph each serves all steps. The attention between them takes one more step's keys at each step (its kernel
        is compiled on its own where it is flex attention). EAGLE-3.1's norms are regions of their own: fc's
        (``_first_hidden``, once per forward) and the output norm (``_output``, once per step)."""
        regions = [(self, "_layer_input"), (self.layer, "qkv"), (self.layer, "finish")]
        if self.fc_norm_on or self.norm_before_fc:
            regions.append((self, "_first_hidden"))
        if self.norm_output:
            regions.append((self, "_output"))
        return regions

    def train_mask(self, batch: Mapping[str, Tensor], k: int) -> Tensor:
        """[B, T]: step k at position t (fed token t + 1 + k, predicting t + 2 + k) is trained when that token is
        loss-bearing and the one it was fed is real; the last k + 2 positions never are."""
        attn_BT = batch["attention_mask"].bool()
        valid_BT = batch["loss_mask"].bool() & attn_BT
        T = valid_BT.shape[1]
        mask_BT = torch.zeros_like(valid_BT)
        mask_BT[:, : max(T - 2 - k, 0)] = valid_BT[:, 2 + k:] & attn_BT[:, 1 + k: T - 1]
        return mask_BT

    def _ttt_attention(self, q: Tensor, keys: list[tuple[Tensor, Tensor]], mask: StructuredMask) -> Tensor:
        """Step j's queries over step 0's keys (causal, padding masked) and steps 1..j's keys at the same position
        (``heads.train_attention.ttt_step_mask``), with the steps' keys side by side, through the kernel
        ``trainer.attention`` picks (no [T, T] mask or score tensor). Steps j >= 1 of short right-padded rows on a
        CPU under ``auto``: ``explicit_ttt_attention`` instead, the same up to float rounding and faster there (see
        ``heads.eagle.attention``); step 0 is SDPA's causal kernel, which it cannot beat."""
        B, h, T, _ = q.shape
        if (len(keys) > 1 and q.device.type == "cpu" and chosen() == "auto" and mask.right_padded
                and self.sliding_window is None  # it computes the plain TTT mask only
                and T <= EXPLICIT_MAX_SEQ and B * h * T * (T + len(keys)) <= EXPLICIT_ATTENTION_ELEMENTS):
            return explicit_ttt_attention(q, keys)
        if len(keys) == 1:
            k, v = keys[0]
        else:
            k, v = torch.cat([kv[0] for kv in keys], 2), torch.cat([kv[1] for kv in keys], 2)
        return attend(q, k, v, mask)

    def _step_loss(self, out_BTD: Tensor, teacher_out: TeacherOutput, feats_BTX: Tensor, mask_BT: Tensor,
                   j: int) -> tuple[DraftTerm, Tensor | None]:
        """Step j at t is compared with the teacher at t+1+j (its logits predict token t+2+j). Every position
        t < T-2-j is a row (``mask_BT`` is False past it), weighted 0/1 by ``mask_BT``: static shapes, no sync."""
        B, T = mask_BT.shape
        n = max(T - 2 - j, 0)
        weight_N = mask_BT[:, :n].reshape(-1).float()
        out_ND = out_BTD[:, :n].reshape(B * n, -1)
        term = self._term(out_ND, teacher_out, *slice_positions(B, n, 1 + j, out_BTD.device), weight_N, j)
        if not self.feature_loss_weight:
            return term, None
        # EAGLE-1's one feature: the target's feature at t+1+j
        target_ND = feats_BTX[:, 1 + j: 1 + j + n].reshape(B * n, -1).float()
        feat_N = F.smooth_l1_loss(out_ND.float(), target_ND, reduction="none").mean(-1)
        feat = torch.where(weight_N > 0, feat_N, 0).sum()
        return term, self.feature_loss_weight * self.loss_decay ** j * feat

    def _term(self, out_ND: Tensor, teacher_out: TeacherOutput, b_N: Tensor, t_N: Tensor, weight_N: Tensor,
              j: int) -> DraftTerm:
        """Step j's distillation term: the outputs ``out_ND`` against the teacher's rows (``b_N``, ``t_N``), each row
        weighted 0/1 by ``weight_N``."""
        student_ND, head = self._vocab_projection(out_ND)
        teacher = TeacherRows(teacher_out, b_N, t_N)
        if self.draft_vocab_size != self.dims.vocab_size:
            # The draft vocabulary's columns only (gathered per loss chunk, no full-row copy); agreement counts the
            # target's top token, -1 (never matched) when it is not drafted.
            teacher.cols, teacher.label_map = self.d2t, self.t2d
        return DraftTerm(student_ND, head, teacher, weight=self.kl_weight * self.loss_decay ** j, weight_N=weight_N)

    # --- decoding ------------------------------------------------------------------------------------------
    def static_draft(self, committed, capacity: int, sampling: SamplingConfig, generator):
        """The catch-up and the whole tree (or chain) as one capture-safe step (``heads.eagle.draft``), drafting
        ``depth`` levels, at most as deep as the committed buffers allow (their rows - 1, the decoder's draft
        length). Candidates are top-k picks for any ``sampling``; ``generator`` is unused."""
        rows = committed.ids_M.shape[0]
        depth = min(self.depth or rows - 1, rows - 1)
        settings = (self.tree_mode, self.top_k, depth, self.total_tokens)
        return self.reuse_static_draft(settings, committed, capacity, sampling, generator,
                                       lambda: EagleStaticDraft(self, committed, capacity, depth))
