"""Each drafter kind's training FLOPs for one [B, T] micro-batch, from its sizes alone (``distill.flops`` has the
conventions and the pieces). Each kind's ``train_flops`` hook calls its function here, so the counts sit together
and the drafter files keep a two-line hook.

Layers run over every position, padded or not; only the rows a loss term trains and the anchors a DFlash / P-EAGLE
batch draws depend on the data. Those are taken for full rows (every token real and loss-bearing), sampled anchor
positions at their expected value (uniform over the candidates: what a run averages to). Rows with padding or
unsupervised tokens train fewer rows than counted: there the figure is an upper bound.
"""

from __future__ import annotations

from distill.flops import Flops, StepFlops, TargetShape, attention, causal_pairs, matmul, projected_rows, total


def _mlp(rows: float, D: int, inter: int) -> Flops:
    """A trainable gated MLP (gate, up: D -> I; down: I -> D) whose input needs a gradient."""
    return matmul(rows, D, inter, True, True) * 2 + matmul(rows, inter, D, True, True)


def _teacher_term_rows(target: TargetShape, B: int, T: int, dense: bool, term_rows: list[float], covered: float,
                       sliced: bool) -> Flops:
    """The teacher's FLOPs for a drafter asking ``dense`` whose terms read ``term_rows`` rows (``projected_rows``)."""
    form = target.form(dense)
    return target.signals(B, T, form, projected_rows(B, T, term_rows, covered, sliced) if form == "projected" else 0)


def eagle(d, target: TargetShape, B: int, T: int) -> StepFlops:
    """EAGLE-1 / EAGLE-3 (``heads.eagle``): per TTT step j the decoder layer over all T positions, attending to step
    0's causal keys and its own earlier steps' keys (dense: the (j+1)T columns the fused kernel is given), then the
    vocabulary projection of its T - 2 - j trained rows. With a sliding window W, step j's queries (at positions t + j)
    see the step-0 keys of the last W - j positions."""
    D, V, Vd = d.dims.hidden_size, d.dims.vocab_size, d.draft_vocab_size
    layer, eagle3 = d.layer, d.variant == "eagle3"
    h, hd, inter, width_in = layer.num_heads, layer.head_dim, layer.gate_proj.out_features, layer.q_proj.in_features
    rows, parts, term_rows = B * T, [], []
    if eagle3:  # fc over the target's features (no gradient into them)
        parts.append(matmul(rows, d.fc.in_features, D, grad_weight=True))
    for j in range(d._ttt_now):
        n = T - 2 - j
        if n <= 0:
            break
        if not eagle3:  # fc([emb ; hid]): hid is step j-1's output (needs a gradient) from step 1 on
            parts.append(matmul(rows, 2 * D, D, grad_input=j > 0, grad_weight=True))
        parts += [matmul(rows, width_in, D, True, True) * 3, matmul(rows, D, D, True, True), _mlp(rows, D, inter),
                  attention(B, h, T, (j + 1) * T, hd, _step_pairs(T, d.sliding_window, j) + j * T)]
        # the trained rows' projection: EAGLE-3's own lm_head (trains), EAGLE-1's the target's (frozen)
        parts.append(matmul(B * n, D, Vd if eagle3 else V, grad_input=True, grad_weight=eagle3))
        term_rows.append(B * n)
    teacher = _teacher_term_rows(target, B, T, d.dense_teacher_logits, term_rows, max(term_rows, default=0), Vd != V)
    return StepFlops(teacher, total(parts))


def peagle(d, target: TargetShape, B: int, T: int) -> StepFlops:
    """P-EAGLE (``heads.peagle``): one pass of EAGLE-3's layer (and any upper layers) over Q = T + slots queries, the
    slots being ``depth_counts`` of a full row's T - 3 anchors; a depth-d query of the chain at anchor a attends to
    the a + 1 context keys up to its anchor and its chain's d slots (dense: all Q x Q)."""
    D, V, Vd = d.dims.hidden_size, d.dims.vocab_size, d.draft_vocab_size
    layer = d.layer
    h, hd, inter = layer.num_heads, layer.head_dim, layer.gate_proj.out_features
    candidates = max(T - 3, 0)
    counts = d.depth_counts(candidates)
    Q = T + sum(counts)
    window = d.sliding_window
    # anchors uniform over 0 .. T-4: a + 1 context keys (within the window of the slot's position a + depth)
    mean_keys = [sum(min(a + 1, _seen(window, depth)) for a in range(candidates)) / max(candidates, 1)
                 for depth in range(1, len(counts) + 1)]
    pairs = causal_pairs(T, window) + sum(n * (keys + depth) for n, keys, depth in
                                          zip(counts, mean_keys, range(1, len(counts) + 1)))
    parts = [matmul(B * T, d.fc.in_features, D, grad_weight=True),
             matmul(B * Q, layer.q_proj.in_features, D, True, True) * 3, matmul(B * Q, D, D, True, True),
             _mlp(B * Q, D, inter), attention(B, h, Q, Q, hd, pairs)]
    for _ in d.upper:
        parts += [matmul(B * Q, D, D, True, True) * 4, _mlp(B * Q, D, inter), attention(B, h, Q, Q, hd, pairs)]
    term_rows = [B * max(T - 2, 0)]
    for depth, n in enumerate(counts, start=1):  # chains whose token a + 2 + depth lies inside the row
        kept = B * n * min(1.0, max(T - 2 - depth, 0) / max(candidates, 1))
        if kept <= 0:
            break
        term_rows.append(kept)
    parts += [matmul(r, D, Vd, True, True) for r in term_rows]
    teacher = _teacher_term_rows(target, B, T, d.dense_teacher_logits, term_rows, term_rows[0], Vd != V)
    return StepFlops(teacher, total(parts))


def _seen(window: int | None, offset: int) -> float:
    """Context keys a query ``offset`` positions past its last context position may see: all, or the window's."""
    return float("inf") if window is None else max(0, window - offset)


def _step_pairs(T: int, window: int | None, step: int) -> float:
    """(query, step-0 key) pairs of TTT step ``step``: query t sees keys <= t, those within the window of t + step."""
    if window is None:
        return causal_pairs(T)
    return sum(min(t + 1, _seen(window, step)) for t in range(T))


def dflash(d, target: TargetShape, B: int, T: int) -> StepFlops:
    """DFlash (``heads.dflash``): N = min(num_anchors, T - 2) blocks of S slots per row through every draft layer;
    context keys from the T fused target states; a block attends to the context before its anchor and its own S
    positions (dense: N*S x (T + N*S)); slots 1..S-1 projected through the target's frozen lm_head."""
    D, V, S = d.dims.hidden_size, d.dims.vocab_size, d.block_size
    candidates = max(T - 2, 0)  # anchors 1 .. T-2
    N = min(d.num_anchors, candidates)
    share = N / max(candidates, 1)  # each candidate's chance of being drawn
    window = d.sliding_window
    # allowed pairs per row: every drawn block's S queries see the context before the anchor (within the window)
    if window is None:
        ctx_pairs = S * candidates * (candidates + 1) / 2
    else:  # query a + s sees the context keys c < a with a + s - c < window
        ctx_pairs = sum(max(0, a - max(0, a + s - window + 1)) for a in range(1, candidates + 1) for s in range(S))
    pairs = share * ctx_pairs + N * S * S
    parts = [matmul(B * T, d.fc.in_features, D, grad_weight=True)]
    for layer in d.layers:
        attn = layer.self_attn
        q_out, kv_out, inter = attn.q_proj.out_features, attn.k_proj.out_features, layer.mlp.gate_proj.out_features
        parts += [matmul(B * T, D, kv_out, True, True) * 2,  # context keys and values
                  matmul(B * N * S, D, q_out, True, True), matmul(B * N * S, D, kv_out, True, True) * 2,
                  matmul(B * N * S, q_out, D, True, True), _mlp(B * N * S, D, inter),
                  attention(B, attn.h, N * S, T + N * S, attn.hd, pairs)]
    term_rows = []
    for k in range(1, S):
        kept = B * share * max(T - 1 - k, 0)  # drawn anchors a with a + k inside the row
        if kept <= 0:
            break
        term_rows.append(kept)
    parts += [matmul(r, D, V, grad_input=True) for r in term_rows]
    if d.objective == "ce":  # hard labels: the teacher's argmax over every row, projected once before the terms
        teacher = _teacher_term_rows(target, B, T, d.dense_teacher_logits, [], 0, False)
    else:
        covered = B * candidates * (1 - (1 - share) ** (S - 1))  # a position read by at least one drawn block
        teacher = _teacher_term_rows(target, B, T, d.dense_teacher_logits, term_rows, covered, False)
    return StepFlops(teacher, total(parts))


def dflash2(d, target: TargetShape, B: int, T: int) -> StepFlops:
    """DFlash2 (``heads.dflash2``): DFlash's count, plus per draft layer the two block convolutions' kernel
    projections (D -> 2 K G over every block slot, trained), and the selector's training term: each trained slot's
    unary logits over the whole vocabulary (no gradient: the candidates), the state's projection (D -> r, its weight
    trained) and the K candidates' pair scores (r each, the codebooks trained). The convolutions' elementwise
    products are not counted, as no norm or activation is."""
    base = dflash(d, target, B, T)
    D, V, S = d.dims.hidden_size, d.dims.vocab_size, d.block_size
    N = min(d.num_anchors, max(T - 2, 0))
    parts = []
    if d.conv:
        for layer in d.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                parts.append(matmul(B * N * S, D, conv.kernel_projection.out_features, True, True))
    if d.candidate_selector is not None:
        rank = d.candidate_selector.hidden_projection.out_features
        rows = B * N * (S - 1)
        parts += [matmul(rows, D, V), matmul(rows, D, rank, grad_weight=True),
                  matmul(rows * d.selector_top_k, rank, 1, grad_weight=True)]
    return StepFlops(base.teacher, base.drafter + total(parts)) if parts else base


def medusa(d, target: TargetShape, B: int, T: int, hidden_needs_grad: bool = False) -> StepFlops:
    """Medusa (``heads.medusa``): head k+1's ResBlocks and its D -> V projection over its B(T-k-2) trained rows; the
    first matmul reads the target's state, which needs no gradient (Medusa-2's joint stage: it does)."""
    D, V = d.dims.hidden_size, d.dims.vocab_size
    parts = []
    for i, head in enumerate(d.heads):
        rows = B * (T - i - 2)
        if rows <= 0:
            break
        grad_input = hidden_needs_grad
        for _ in range(len(head) - 1):
            parts.append(matmul(rows, D, D, grad_input, True))
            grad_input = True
        parts.append(matmul(rows, D, V, grad_input, True))
    return StepFlops(target.signals(B, T, target.form(d.dense_teacher_logits)), total(parts))


def medusa2(d, target: TargetShape, B: int, T: int) -> StepFlops:
    """Medusa-2 (``heads.medusa.medusa2``): before ``heads_only_steps``, Medusa's count; in the joint stage also the adapted
    target's forward and backward (frozen base weights 1x on the gradient's way, the LoRA trains), its last position's
    logits, and its next-token loss through the frozen lm_head over B(T-1) rows."""
    if not d._joint:
        return medusa(d, target, B, T)
    heads = medusa(d, target, B, T, hidden_needs_grad=True)
    lm = target.lm
    adapted = lm.train(B, T) + lm.lm_head(B)
    if d.lm_loss_weight:
        adapted = adapted + lm.lm_head(B * (T - 1), grad_input=True)
    return StepFlops(heads.teacher, heads.drafter + adapted)


def draft_model(d, target: TargetShape, B: int, T: int) -> StepFlops:
    """A standalone draft LM (``heads.draft_model``): its forward and backward over B x T tokens, then its output
    embedding over the B(T-1) trained rows (in loss chunks; projected whole inside the forward when it cannot be)."""
    from distill.flops import LMShape

    lm = LMShape.of(d.model)
    drafter = lm.train(B, T)
    if d.projects_in_chunks:  # the forward's last position (logits_to_keep=1), then the loss chunks
        drafter = drafter + lm.lm_head(B) + lm.lm_head(B * (T - 1), True, lm.head_trainable)
    else:
        drafter = drafter + lm.lm_head(B * T, True, lm.head_trainable)
    rows = B * (T - 1)
    return StepFlops(_teacher_term_rows(target, B, T, d.dense_teacher_logits, [rows], rows, False), drafter)
