"""DFlash: a block-diffusion drafter that fills a whole block of masked positions in one forward.

Which token each output predicts: a block is anchored at position a (the last verified token, whose target hidden
state is not known yet): its inputs are [token a, MASK, ..., MASK] at positions a .. a + block_size - 1, and the
output at block slot k >= 1 (position a + k) predicts token a + k itself (the target's distribution at a + k - 1).
One forward drafts the chain of block_size - 1 tokens after the anchor.

Shape legend:  B batch, T sequence, D target hidden size (= the drafter's), V target vocabulary, F number of target
feature layers, L draft layers, S block size, N anchors per row, h query heads, g key/value heads, hd head size.
    context  c_TD = hidden_norm(fc([feat_1 ; ... ; feat_F]))       (F*D -> D, no bias): the target's context
    per draft layer l (Qwen3-style, non-causal within the block):
             x  = input_layernorm(h_SD)
             q  = q_norm(q_proj(x))                                  queries: the block's S positions only
             k  = k_norm(k_proj([c ; x])), v = v_proj([c ; x])      keys: context positions < a, then the block
             h  = h + o_proj(attn(q, k, v));  h = h + mlp(post_attention_layernorm(h))
    out_SD = norm(h) -> the target's frozen lm_head -> logits_SV; slots 1 .. S-1 are the drafts.
    With ``draft_vocab_size`` = Vd, decoding reads only the lm_head rows of the Vd target ids most frequent in the
    training data (``d2t`` [Vd]); the other ids get -inf (training is unchanged: the whole vocabulary).
The context keys of a layer depend on the fused target features alone (never on the layer's input), so decoding
caches them once per committed position, as the anchors' engines do.

Feature layers use ``distill.teacher``'s hidden-state index (i = output of decoder layer i, 1-based); the anchors'
``target_layer_ids`` are 0-based layer numbers, i.e. index - 1 (an exporter converts). Default: the anchors' spread
(one feature layer per draft layer, from layer 1 to L - 3; the middle layer for a one-layer drafter).

Training (the anchors' recipe): up to ``num_anchors`` random anchor positions per row, every anchor's block drafted
in the same forward (one attention over [context ; all blocks] under ``block_mask``, run by
``heads.train_attention`` without a [queries, keys] tensor: a block sees the context strictly
before its anchor and its own S positions); slot k's loss weight is exp(-(k - 1) / loss_gamma). ``objective: ce``
(the anchors'): cross-entropy on the target's tokens (its greedy token at a + k - 1, which greedy decoding must
match); ``objective: distill``: the configured divergence (``loss=``) against the target's distribution.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill.chunked import Frozen, LabelRows, TeacherRows, cross_entropy_sum
from distill.teacher_output import TeacherOutput
from heads import flops
from heads.base import Drafter, DraftOutput, DraftTerm, TargetDims
from heads.dflash.draft import DFlashStaticDraft
from heads.dflash.layers import DFlashLayer
from heads.layers import RMSNorm, vocab_maps
from heads.train_attention import dflash_block_mask
from inference.sampling import SamplingConfig

log = logging.getLogger(__name__)

OBJECTIVES = ("ce", "distill")
GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}  # the anchors' loss decay per block size


def default_feature_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The anchors' spread as hidden-state indices: one layer per draft layer, evenly from 0-based layer 1 to
    L - 3 (index 2 .. L - 2); a one-layer drafter reads the middle layer (index L // 2 + 1). Shallow targets (L < 5,
    the toy) spread over indices 1 .. L - 1 instead (never L, the final normed output no engine captures), without
    repeats."""
    L, n = num_target_layers, num_draft_layers
    if L >= 5:
        if n == 1:
            return (L // 2 + 1,)
        return tuple(int(round(1 + i * (L - 4) / (n - 1))) + 1 for i in range(n))
    top = max(1, L - 1)
    if n == 1:
        return (max(1, top // 2 + top % 2),)
    return tuple(sorted({int(round(1 + i * (top - 1) / (n - 1))) for i in range(n)}))


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The id whose embedding fills the masked slots, as the anchors pick it: the tokenizer's own mask token; else a
    dedicated id no text produces: the first id past the tokenizer's tokens (where SpecForge adds ``<|MASK|>`` to a
    tokenizer without a mask token; for Qwen3, 151669, an embedding row the target pads); else, on a vocabulary the
    tokenizer fills (the toy's), the last id."""
    mask = getattr(tokenizer, "mask_token_id", None)
    if isinstance(mask, int) and 0 <= mask < vocab_size:
        return mask
    size = len(tokenizer) if tokenizer is not None else vocab_size
    return size if size < vocab_size else vocab_size - 1


def default_loss_gamma(block_size: int) -> float:
    return GAMMA_BY_BLOCK.get(block_size, max(1.0, (block_size - 1) / 2))


@dataclass
class TargetTokens(LabelRows):
    """The target's own tokens as hard labels (``objective: ce``); agreement counts the same tokens."""

    def labels(self) -> Tensor:
        return self.labels_N


@dataclass
class TokenTerm(DraftTerm):
    """A draft term trained with cross-entropy on ``TargetTokens`` whatever divergence is configured."""

    def evaluate(self, loss_fn) -> Tensor:
        return super().evaluate(cross_entropy_sum)


class DFlashDrafter(Drafter):
    name = "dflash"
    dense_teacher_logits = False  # each term reads its teacher rows once
    decode_keys = ("depth",)

    def __init__(self, dims: TargetDims | Mapping[str, int], block_size: int = 16, num_layers: int = 1,
                 layers: Sequence[int] | None = None, num_heads: int | None = None, num_kv_heads: int | None = None,
                 intermediate_size: int | None = None, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
                 mask_token_id: int | None = None, num_anchors: int = 512, loss_gamma: float | None = None,
                 objective: str = "ce", depth: int | None = None, sliding_window: int | None = None,
                 draft_vocab_size: int | None = None):
        super().__init__(dims)
        D, V, L = self.dims.hidden_size, self.dims.vocab_size, self.dims.num_layers
        if block_size < 2:
            raise ValueError(f"drafter.block_size={block_size} must be >= 2 (the anchor token plus at least one draft)")
        if num_layers < 1:
            raise ValueError(f"drafter.num_layers={num_layers} must be >= 1")
        layers = tuple(default_feature_layers(L, num_layers) if layers is None else layers)
        if not layers:
            raise ValueError("drafter.layers is empty; give the hidden-state indices to read (or null for the default)")
        for i in layers:
            if not 0 <= i <= L:
                raise ValueError(f"drafter.layers contains {i}, out of range for a target with {L} layers; valid "
                                 f"hidden-state indices are 0..{L} (i = output of decoder layer i)")
        if objective not in OBJECTIVES:
            raise ValueError(f"drafter.objective={objective!r} is not known; valid: {list(OBJECTIVES)} (ce: "
                             f"cross-entropy on the target's tokens; distill: the configured loss=)")
        if num_anchors < 1:
            raise ValueError(f"drafter.num_anchors={num_anchors} must be >= 1 (blocks trained per row)")
        self._mask_given = mask_token_id is not None  # null: resolved from the target's tokenizer when bound
        mask_token_id = V - 1 if mask_token_id is None else mask_token_id
        if not 0 <= mask_token_id < V:
            raise ValueError(f"drafter.mask_token_id={mask_token_id} is outside the target's vocabulary 0..{V - 1}")
        if depth is not None and not 1 <= depth <= block_size - 1:
            raise ValueError(f"drafter.depth={depth} must be in 1..block_size-1={block_size - 1} (or null)")
        self.teacher_layers = layers
        self.block_size, self.num_anchors, self.objective, self.depth = block_size, num_anchors, objective, depth
        self.mask_token_id = mask_token_id
        if sliding_window is not None and sliding_window < block_size:
            raise ValueError(f"drafter.sliding_window={sliding_window} must be >= block_size={block_size} (a query "
                             f"must see its whole block) or null (full attention)")
        self.sliding_window = sliding_window
        self.loss_gamma = default_loss_gamma(block_size) if loss_gamma is None else float(loss_gamma)
        if self.loss_gamma <= 0:
            raise ValueError(f"drafter.loss_gamma={loss_gamma} must be > 0 (slot k's weight: exp(-(k-1)/gamma))")
        heads = num_heads or max(1, D // 64)
        if D % heads:
            raise ValueError(f"drafter.num_heads={heads} must divide the target's hidden size {D}")
        kv = num_kv_heads or heads
        inter = intermediate_size or 64 * math.ceil(8 * D / 3 / 64)
        self.fc = nn.Linear(len(layers) * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(D, heads, kv, D // heads, inter, rms_norm_eps, rope_theta)
                                     for _ in range(num_layers)])  # built separately: no shared weights
        self.norm = RMSNorm(D, rms_norm_eps)
        if draft_vocab_size is not None and draft_vocab_size < 1:
            raise ValueError(f"drafter.draft_vocab_size={draft_vocab_size} must be >= 1 or null (draft over every id)")
        if draft_vocab_size is not None and draft_vocab_size >= V:
            if draft_vocab_size > V:
                log.warning("drafter.draft_vocab_size=%d exceeds the target's vocab_size %d: drafting over the full "
                            "vocabulary", draft_vocab_size, V)
            draft_vocab_size = None
        self.draft_vocab_size = draft_vocab_size
        if draft_vocab_size is not None:  # the drafted ids (``prepare``: the most frequent in the training data)
            self.register_buffer("d2t", torch.arange(draft_vocab_size), persistent=True)
        self._head_rows: tuple | None = None  # (key, the lm_head rows of d2t): built once per head / d2t
        self._anchors_checked = False  # whether the data was seen to have an anchor (``_check_anchors``)
        self._frozen: dict[str, nn.Module] = {}  # the target's embedding / lm_head: used, never owned or saved
        self.reset()

    # --- binding to the target ----------------------------------------------------------------------------
    def bind_target(self, teacher, initialize: bool) -> None:
        for i in self.teacher_layers:
            teacher.resolve_layer(i)
        if not self._mask_given:
            self.mask_token_id = default_mask_token_id(teacher.tokenizer, self.dims.vocab_size)
        self._frozen = {"embed": teacher.input_embedding, "lm_head": teacher.output_logits}
        if initialize:
            gain = teacher.final_norm_gain  # start the output norm where the target's ends
            if gain is not None and gain.shape == self.norm.weight.shape:
                with torch.no_grad():
                    self.norm.weight.copy_(gain.to(self.norm.weight))

    def saved_config(self, drafter_cfg: Mapping[str, Any]) -> dict:
        node = dict(drafter_cfg)
        node["layers"] = list(self.teacher_layers)  # resolved defaults, so a load never re-derives them
        node["mask_token_id"] = self.mask_token_id
        node["sliding_window"] = self.sliding_window  # the attention it was trained with
        node["draft_vocab_size"] = self.draft_vocab_size
        return node

    def _embed(self, ids: Tensor, like: Tensor) -> Tensor:
        if "embed" not in self._frozen:
            raise RuntimeError(f"{self.name} is not bound to a target; call bind_target(teacher, ...) first")
        return self._frozen["embed"](ids.to(self._frozen["embed"].weight.device)).to(like.device, like.dtype)

    def _context(self, feats: Tensor) -> Tensor:
        """The fused target context [.., D] from the concatenated feature layers [.., F*D]."""
        return self.hidden_norm(self.fc(feats))

    def _logits(self, out_ND: Tensor) -> Tensor:
        head = self._frozen["lm_head"]
        return head(out_ND.to(head.weight.dtype)).to(out_ND.dtype)

    def prepare(self, dataset) -> None:
        """Check that the training rows have anchors and hold a whole block; with ``draft_vocab_size``: keep the most
        frequent tokens of the training data as the drafted ids."""
        rows = dataset.attention_mask.shape[-1]
        if self.block_size > rows:  # no block fits a row: each step drafts past every row's end, at length S cost
            raise ValueError(f"drafter.block_size={self.block_size} is larger than the training rows (data.max_length="
                             f"{rows} tokens): no block fits in a row; set drafter.block_size <= {rows} (e.g. 16), or "
                             f"raise data.max_length")
        self._check_anchors(self._candidates({"loss_mask": dataset.loss_mask,
                                              "attention_mask": dataset.attention_mask}))
        if self.draft_vocab_size is None:
            return
        ids, mask = dataset.input_ids, dataset.loss_mask.bool() & dataset.attention_mask.bool()
        counts = torch.bincount(ids[mask].reshape(-1), minlength=self.dims.vocab_size)[: self.dims.vocab_size]
        d2t, _ = vocab_maps(counts, self.draft_vocab_size)
        self.d2t.copy_(d2t)
        covered = counts[d2t].sum().item() / max(1, counts.sum().item())
        log.info("dflash draft vocabulary: %d of %d ids, covering %.1f%% of the training tokens",
                 self.draft_vocab_size, self.dims.vocab_size, 100 * covered)

    def head_rows(self) -> Tensor | None:
        """The lm_head rows of the drafted ids [Vd, D] (None: every id), cut once per head weight and ``d2t``."""
        if self.draft_vocab_size is None:
            return None
        w = self._frozen["lm_head"].weight
        key = (w.data_ptr(), w._version, w.dtype, self.d2t.data_ptr(), self.d2t._version)
        if self._head_rows is None or self._head_rows[0] != key:
            with torch.no_grad():
                self._head_rows = (key, w.detach().index_select(0, self.d2t.to(w.device)))
        return self._head_rows[1]

    def draft_logits(self, out_ND: Tensor, rows: Tensor | None = None) -> Tensor:
        """Decoding's logits [N, V] of the drafted slots: the whole lm_head, or with ``draft_vocab_size`` only its
        ``rows`` (``head_rows()``) and -inf for every other id."""
        if self.draft_vocab_size is None:
            return self._logits(out_ND)
        rows = self.head_rows() if rows is None else rows
        return self.expand_draft(F.linear(out_ND.to(rows.dtype), rows).to(out_ND.dtype))

    def expand_draft(self, sub_NVd: Tensor) -> Tensor:
        """[N, V] logits from draft-vocabulary ones [N, Vd]: -inf for every id outside ``d2t``."""
        full = sub_NVd.new_full((sub_NVd.shape[0], self.dims.vocab_size), float("-inf"))
        return full.index_copy_(1, self.d2t.to(sub_NVd.device), sub_NVd)

    # --- training ------------------------------------------------------------------------------------------
    def train_flops(self, target, B: int, T: int):
        return flops.dflash(self, target, B, T)

    def _candidates(self, batch: Mapping[str, Tensor]) -> Tensor:
        """[B, T] bool: positions a that may anchor a block (a real token with a real context before it and a
        loss-bearing token after it)."""
        attn = batch["attention_mask"].bool()
        valid = batch["loss_mask"].bool() & attn
        cand = torch.zeros_like(valid)
        cand[:, 1:-1] = attn[:, 1:-1] & valid[:, 2:] & attn[:, :1]
        return cand

    def _check_anchors(self, cand_BT: Tensor) -> None:
        """Rows too short for a block (no anchor in any) are a data setting to fix: raise, naming it. Done once
        (``prepare``, or the first training forward), never per step: the check reads a value back from the device."""
        if not cand_BT.any():
            raise ValueError(f"data.max_length={cand_BT.shape[1]} is too short for {self.name}: no row has an anchor "
                             f"(a token with context before it and a loss-bearing token after it)")
        self._anchors_checked = True

    def train_mask(self, batch: Mapping[str, Tensor], k: int) -> Tensor:
        """[B, T]: anchors a whose slot k + 1 (predicting token a + k + 1) is trainable, were a drawn (training draws
        at most ``num_anchors`` of them per row at random)."""
        valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        cand = self._candidates(batch)
        T = valid.shape[1]
        mask = torch.zeros_like(cand)
        mask[:, : max(T - k - 1, 0)] = cand[:, : max(T - k - 1, 0)] & valid[:, k + 1:]
        return mask

    def count_valid(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Anchors drawn (each trains slot 1): min(num_anchors, candidates) per row."""
        return self._candidates(batch).sum(1).clamp(max=self.num_anchors).sum()

    def _draw_anchors(self, cand_BT: Tensor) -> tuple[Tensor, Tensor]:
        """(anchors [B, N], drawn [B, N]): up to ``num_anchors`` candidates per row, uniformly without replacement
        (all of them when fewer), in increasing position order. N is static: ``num_anchors``, or the most candidates a
        row of length T can have (T - 2) when fewer; slots beyond a row's candidates are undrawn (the top picks of
        a larger k are the same candidates, so the draw does not depend on N)."""
        score = torch.rand(cand_BT.shape, device=cand_BT.device).masked_fill(~cand_BT, -1.0)
        n = min(self.num_anchors, cand_BT.shape[1] - 2)
        top, idx = score.topk(max(n, 1), dim=1)
        drawn = top >= 0
        idx = torch.where(drawn, idx, cand_BT.shape[1])  # undrawn slots sort last
        idx, order = idx.sort(1)
        return idx.clamp(max=cand_BT.shape[1] - 1), drawn.gather(1, order)

    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput, loss_fn=None) -> DraftOutput:
        out, pos_BNS, drawn = self.train_blocks(batch, teacher_out)
        terms = self.block_terms(out, Frozen(self._frozen["lm_head"]), pos_BNS, drawn, batch, teacher_out)
        return DraftOutput(terms=terms, num_valid=drawn.sum()).evaluate(loss_fn)

    def train_blocks(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput) -> tuple[Tensor, Tensor, Tensor]:
        """Every drawn anchor's block in one forward: (out [B, N, S, D]: the normed block states, block positions
        [B, N, S], drawn [B, N]: which of the N anchor slots hold a drawn anchor)."""
        ids, attn = batch["input_ids"], batch["attention_mask"].bool()
        B, T = ids.shape
        S = self.block_size
        cand = self._candidates(batch)
        if not self._anchors_checked:  # once: a check per step would make the host wait for the device
            self._check_anchors(cand)
        feats = torch.cat([teacher_out.hidden[i] for i in self.teacher_layers], -1)
        dtype = self.fc.weight.dtype if not torch.is_autocast_enabled(feats.device.type) else feats.dtype
        ctx = self._context(feats.to(dtype))  # [B, T, D]
        anchors, drawn = self._draw_anchors(cand)  # [B, N]
        N = anchors.shape[1]
        dev = ids.device
        slot = torch.arange(S, device=dev)
        pos_BNS = anchors[..., None] + slot  # block positions
        block_ids = torch.full((B, N, S), self.mask_token_id, dtype=torch.long, device=dev)
        block_ids[..., 0] = ids.gather(1, anchors)
        h = self._embed(block_ids.view(B, N * S), ctx)  # [B, N*S, D]
        pos_q = pos_BNS.view(B, N * S)
        mask = dflash_block_mask(anchors, attn, S, self.sliding_window)  # N*S queries over T + N*S keys
        ctx_pos = torch.arange(T, device=dev)
        for layer in self.layers:
            h = layer(h, pos_q, None, None, mask, ctx_BTD=ctx, ctx_pos=ctx_pos)
        return self.norm(h).view(B, N, S, -1), pos_BNS, drawn

    def block_terms(self, feats_BNSX: Tensor, head, pos_BNS: Tensor, drawn: Tensor, batch: Mapping[str, Tensor],
                    teacher_out: TeacherOutput) -> list[DraftTerm]:
        """One term per drafted slot k = 1 .. S - 1: ``head`` over slot k's features ``feats_BNSX[:, :, k]`` (the
        block states, or what a subclass's head reads beside them) against the target's token / distribution."""
        B, N, S, _ = feats_BNSX.shape
        T = batch["input_ids"].shape[1]
        dev = feats_BNSX.device
        valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        terms = []
        # Every slot of every block is a row of its term, weighted by whether it trains (an empty term weighs 0):
        # static shapes, no sync.
        b_N = torch.arange(B, device=dev)[:, None].expand(B, N).reshape(-1)
        for k in range(1, S):
            target = pos_BNS[..., k]  # [B, N]: the token slot k predicts
            rows = drawn & (target < T)
            rows &= valid.gather(1, target.clamp(max=T - 1))
            weight_N = rows.reshape(-1).float()
            t_N = self.slot_teacher_positions(pos_BNS, k, T)
            weight = self.slot_weight(k)
            student = feats_BNSX[:, :, k].reshape(B * N, -1)
            if self.objective == "ce":
                labels = teacher_out.argmax_BT()[b_N, t_N]
                terms.append(TokenTerm(student, head, TargetTokens(labels, self.dims.vocab_size), weight=weight,
                                       weight_N=weight_N))
            else:
                terms.append(DraftTerm(student, head, TeacherRows(teacher_out, b_N, t_N), weight=weight,
                                       weight_N=weight_N))
        return terms

    @staticmethod
    def slot_teacher_positions(pos_BNS: Tensor, k: int, T: int) -> Tensor:
        """[B * N] the position of the target's distribution over the token block slot k predicts (token a + k: the
        distribution sits at a + k - 1), clamped into the row for slots past its end (those rows weigh 0)."""
        return pos_BNS[..., k].clamp(max=T).reshape(-1) - 1

    def slot_weight(self, k: int) -> float:
        """Block slot k's loss weight, exp(-(k - 1) / loss_gamma)."""
        return math.exp(-(k - 1) / self.loss_gamma)

    # --- decoding ------------------------------------------------------------------------------------------
    def static_draft(self, committed, capacity: int, sampling: SamplingConfig, generator):
        """The catch-up and the whole block as one capture-safe step (``heads.dflash.draft``), drafting ``depth``
        tokens, at most as many as the committed buffers allow (their rows - 1, the decoder's draft length) and the
        block holds."""
        rows = committed.ids_M.shape[0]
        depth = min(self.depth or self.block_size - 1, rows - 1, self.block_size - 1)
        # keyed by the weights' dtype too: its buffers are allocated in it (eval times each candidate dtype)
        return self.reuse_static_draft((depth, self.fc.weight.dtype), committed, capacity, sampling, generator,
                                       lambda: DFlashStaticDraft(self, committed, capacity, depth, sampling,
                                                                 generator))


def block_mask(anchors_BN: Tensor, attn_BT: Tensor, block_size: int, window: int | None = None) -> Tensor:
    """[B, 1, N*S, T + N*S] bool, ``heads.train_attention.dflash_block_mask`` as a dense tensor: block n's queries
    see the real context positions before its anchor (with ``window``: only those less than ``window`` positions
    before the query's own) and every position of their own block (non-causal), nothing of the other blocks."""
    return dflash_block_mask(anchors_BN, attn_BT, block_size, window).dense(attn_BT.device)
