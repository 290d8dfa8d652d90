"""One speculative decode loop for every drafter and any Hugging Face causal LM, plus plain decoding through the
same cache path.

One step: the drafter proposes a chain or tree of candidates continuing the committed sequence; the target runs ONE
forward over [pending token, candidates...] on top of its KV cache (tree attention through a 4D mask and explicit
position ids, ``inference.tree``); the acceptance rule picks the accepted path and one target token; the cache is
compacted to exactly the committed entries, so the next step starts from the state plain decoding would have.

Shapes: a single sequence (batch 1): ``tokens`` [1, n]. The pending token is the last committed token, predicted by
the target but not yet fed to it.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from torch import Tensor
from transformers import Cache

from inference.acceptance import Verdict, decide, read_verdict, tree_rejection_accept, typical_accept, walked
from inference.masks import AttentionLayout
from inference.proposer import Proposer
from inference.sampling import GREEDY, SamplingConfig, sample, warp
from inference.stats import AcceptStats
from inference.tree import DraftTree, compact_cache, verify_inputs

TREE_HEADROOM = 64  # preallocated cache columns for the nodes of one verification forward
ACCEPTANCE_RULES = ("exact", "typical")  # exact: greedy match / rejection sampling (lossless); typical: Medusa's, lossy


@dataclass
class DecoderConfig:
    """``decoder:`` in the Hydra config: how every drafter is decoded and verified in an evaluation."""

    temperature: float = 0.0  # 0: greedy (output token-identical to plain greedy decoding)
    top_p: float = 1.0
    top_k: int = 0
    acceptance: str = "exact"  # exact (lossless) | typical (Medusa's typical acceptance: LOSSY, labelled so)
    typical_threshold: float = 0.09  # ε in p(x) > min(ε, δ·exp(-H(p)))
    typical_alpha: float = 0.3  # δ
    tree: Any = None  # null: each drafter's own; "chain"; a preset (small, default, wide); or top-k index paths
    auto_tune: bool = False  # pick the draft length / tree size with the best predicted speedup (inference.cost)
    seed: int = 0
    # python -m eval: also decode in batches of these sizes (inference.batched) and report throughput, latency and
    # the crossover batch size where speculation stops paying (eval.batch_sweep); null: batch 1 only
    batch_sizes: Optional[List[int]] = None
    policy: str = "always"  # batched decoding: always (γ = eval.num_draft every step) | auto (inference.policy)
    # torch.compile the target's forward for verification and plain steps (the prefill runs eager) with dynamic
    # shapes and one call signature, so a new tree size or context length does not recompile: two graphs, with and
    # without a tree mask; CUDA: mode="reduce-overhead" (CUDA graphs). The first calls pay the compilation (about a
    # minute on CPU for a tiny model).
    compile: bool = False

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.top_k)


@dataclass
class Generation:
    new_tokens: list[int]
    seconds: float
    stats: AcceptStats = field(default_factory=AcceptStats)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    nodes_per_forward: Counter = field(default_factory=Counter)  # tree size -> verification forwards
    # tree size -> node index -> times that node was on the accepted path (static trees: the cost model's input)
    node_accepts: dict = field(default_factory=lambda: defaultdict(Counter))
    context_tokens: int = 0  # committed context length summed over verification forwards (mean = / forwards)
    shapes: dict = field(default_factory=dict)  # tree size -> parents of a tree of that size (to time it alone)

    def merge(self, other: "Generation") -> "Generation":
        """Add ``other`` into this one (an evaluation's total over its prompts): tokens appended, times, counts and
        statistics summed; the first tree shape seen for a size is kept."""
        self.new_tokens = self.new_tokens + list(other.new_tokens)
        self.seconds += other.seconds
        self.stats.merge(other.stats)
        self.prefill_seconds += other.prefill_seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.nodes_per_forward.update(other.nodes_per_forward)
        for size, row in other.node_accepts.items():
            self.node_accepts[size].update(row)
        for size, parents in other.shapes.items():
            self.shapes.setdefault(size, parents)
        self.context_tokens += other.context_tokens
        return self


def finish(committed: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """The new tokens a decode returns: at most ``max_new_tokens``, ending at the first EOS (kept) if any. Every
    decoder and baseline cuts its output here, so their outputs compare token for token."""
    committed = list(committed)[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in committed:
        return committed[: committed.index(eos_token_id) + 1]
    return committed


def check_vocab(drafter: Proposer, vocab_size: int) -> None:
    """A drafter proposes ids of the target's vocabulary (both decoders check it before the first step)."""
    if drafter.dims.vocab_size != vocab_size:
        raise ValueError(
            f"drafter {drafter.name!r} has vocab_size={drafter.dims.vocab_size} but the target has "
            f"{vocab_size}; a drafter must share the target's tokenizer"
        )


def _check_prompt(prompt_ids: Tensor, max_new_tokens: int, lookahead: int, max_positions: int) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must have shape [1, n], got {tuple(prompt_ids.shape)}")
    if prompt_ids.shape[1] == 0:
        raise ValueError("empty prompt: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    needed = prompt_ids.shape[1] + max_new_tokens + lookahead
    if max_positions and needed > max_positions:
        raise ValueError(
            f"prompt of {prompt_ids.shape[1]} tokens + max_new_tokens={max_new_tokens} + {lookahead} draft tokens "
            f"needs {needed} positions, more than the target's max_position_embeddings={max_positions}; "
            f"shorten the prompt (eval.prompt_tokens), or lower eval.max_new_tokens or eval.num_draft"
        )


def prefill_kwargs(model) -> dict:
    """The prefill needs the logits at the last prompt position only (V per position otherwise: at a real vocabulary
    more than the rest of a short decode costs). Models without ``logits_to_keep`` compute them all."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # timings must cover the kernels, not just their launch
        torch.cuda.synchronize(device)


class Decoder:
    """Decodes with a frozen target (a ``distill.teacher.Teacher``) and, optionally, a drafter."""

    def __init__(self, teacher, eos_token_id: int | None = None, sampling: SamplingConfig = GREEDY,
                 acceptance: str = "exact", typical_threshold: float = 0.09, typical_alpha: float = 0.3, seed: int = 0,
                 compile: bool = False):
        if acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"decoder.acceptance={acceptance!r}; valid: {list(ACCEPTANCE_RULES)} (typical is lossy)")
        self.teacher = teacher
        self.model = teacher.model
        self.eos_token_id = eos_token_id
        self.sampling = sampling
        self.acceptance = acceptance
        self.typical = (typical_threshold, typical_alpha)
        self.device = teacher.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.mask_dtype = next(self.model.parameters()).dtype
        # Sliding-window layers see their window through the masks, over a cache that keeps every layer whole
        # (inference.masks), so a context longer than the window decodes like any other.
        self.layout = AttentionLayout.of(self.model)
        self.max_positions = teacher.max_positions
        self.prefill_kw = prefill_kwargs(self.model)
        self._target = self.model  # what ``_forward`` calls for steps: the model, or its compiled forward
        if compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._target = torch.compile(self.model.forward, dynamic=True, mode=mode)

    @property
    def lossless(self) -> bool:
        return self.acceptance == "exact"

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def _forward(self, inputs: dict, cache: Cache, layers: tuple[int, ...]):
        past = cache.get_seq_length()
        if self._target is self.model or not past:  # eager; the prefill always (once per decode, any prompt length)
            out = self.model(**inputs, past_key_values=cache, use_cache=True, output_hidden_states=bool(layers))
        else:  # compiled steps see one call signature, so plain steps, chains and trees share graphs: 2 (mask or not)
            if "position_ids" not in inputs:
                n = inputs["input_ids"].shape[1]
                inputs = {**inputs, "position_ids": torch.arange(past, past + n, device=self.device)[None]}
            out = self._target(**inputs, past_key_values=cache, use_cache=True, output_hidden_states=True)
        hidden = {i: out.hidden_states[self.teacher.resolve_layer(i)] for i in layers}
        return out.logits[0], hidden  # [m, V], {layer: [1, m, D]}

    def _next_token(self, logits_V: Tensor) -> Tensor:
        if self.sampling.greedy:
            return logits_V.argmax(-1, keepdim=True)
        return sample(warp(logits_V[None], self.sampling), self.generator)

    def finish(self, committed: list[int], max_new_tokens: int) -> list[int]:
        """``finish`` with this decoder's EOS."""
        return finish(committed, max_new_tokens, self.eos_token_id)

    @torch.no_grad()
    def plain(self, prompt_ids: Tensor, max_new_tokens: int) -> Generation:
        """Autoregressive decoding (greedy or sampling, per ``self.sampling``): one target forward per token."""
        _check_prompt(prompt_ids, max_new_tokens, 0, self.max_positions)
        _sync(self.device)
        start = time.perf_counter()
        cache = self.layout.new_cache(capacity=prompt_ids.shape[1] + max_new_tokens)
        logits, _ = self._forward({"input_ids": prompt_ids.to(self.device), **self.prefill_kw}, cache, ())
        nxt = self._next_token(logits[-1])
        out = [int(nxt)]
        while len(out) < max_new_tokens and out[-1] != self.eos_token_id:
            logits, _ = self._forward({"input_ids": nxt.view(1, 1)}, cache, ())
            nxt = self._next_token(logits[-1])
            out.append(int(nxt))
        _sync(self.device)
        return Generation(new_tokens=self.finish(out, max_new_tokens), seconds=time.perf_counter() - start)

    def verdict(self, tree: DraftTree, logits_N1V: Tensor) -> Verdict:
        """Accept on the device and read the verdict back once. Malformed proposals are refused here, after the
        forward that saw them clamped."""
        vocab = self.teacher.vocab_size
        if self.acceptance == "typical":  # lossy, Medusa's comparison rule: walked on the host
            tree.check(vocab)
            return walked(tree, *typical_accept(tree, warp(logits_N1V, self.sampling), *self.typical,
                                                generator=self.generator))
        packed = decide(tree, logits_N1V, self.sampling, self.generator, vocab)
        if packed is None:
            tree.check(vocab)
            return walked(tree, *tree_rejection_accept(tree, warp(logits_N1V, self.sampling), self.generator))
        return read_verdict(tree, packed.tolist(), packed, vocab)  # the step's one read-back

    @torch.no_grad()
    def speculative(self, drafter: Proposer, prompt_ids: Tensor, max_new_tokens: int, num_draft: int) -> Generation:
        """Speculative decoding; with ``acceptance="exact"`` the output is distributed exactly as ``plain``'s (and is
        token-identical to it when greedy). ``num_draft`` bounds the depth of each proposal."""
        check_vocab(drafter, self.teacher.vocab_size)
        _check_prompt(prompt_ids, max_new_tokens, num_draft, self.max_positions)
        layers = tuple(drafter.teacher_layers)
        device, vocab = self.device, self.teacher.vocab_size
        gen = Generation(new_tokens=[], seconds=0.0)
        _sync(device)
        start = time.perf_counter()
        # Room for the whole decode plus one verified tree (a larger tree makes the cache grow once)
        cache = self.layout.new_cache(capacity=prompt_ids.shape[1] + max_new_tokens + TREE_HEADROOM)
        drafter.reset(seed=int(torch.randint(0, 2**62, (1,), generator=self.generator, device=device)))
        logits, hidden = self._forward({"input_ids": prompt_ids.to(device), **self.prefill_kw}, cache, layers)
        drafter.observe(hidden)
        nxt = self._next_token(logits[-1])
        tokens = torch.cat([prompt_ids.to(device), nxt.view(1, 1)], dim=1)
        committed = [int(nxt)]
        _sync(device)
        gen.prefill_seconds = time.perf_counter() - start
        while len(committed) < max_new_tokens and committed[-1] != self.eos_token_id:
            t0 = time.perf_counter()
            tree = drafter.propose(tokens, min(num_draft, max_new_tokens - len(committed)), self.sampling)
            tree.check_shape(vocab)
            _sync(device)
            t1 = time.perf_counter()
            past = tokens.shape[1] - 1
            inputs = verify_inputs(tree, tokens[0, -1], past, self.mask_dtype, self.layout, vocab)
            logits, hidden = self._forward(inputs, cache, layers)
            v = self.verdict(tree, logits)
            path, new, path_index = v.path, v.committed, v.path_index
            compact_cache(cache, tree.size, path, path_index)
            _sync(device)
            t2 = time.perf_counter()
            gen.draft_seconds += t1 - t0
            gen.verify_seconds += t2 - t1
            gen.stats.update(v.depth, len(path))
            gen.nodes_per_forward[tree.size] += 1
            if tree.size not in gen.shapes:
                gen.shapes[tree.size] = tree.parents.cpu()
            gen.node_accepts[tree.size].update(path)
            gen.context_tokens += past + 1
            if hidden:  # the pending token's and the accepted nodes' hidden states, in path order
                keep = torch.cat([path_index.new_zeros(1), 1 + path_index[: len(path)]])
                hidden = {i: h.index_select(1, keep) for i, h in hidden.items()}
            drafter.observe(hidden)
            drafter.accepted(path)
            tokens = torch.cat([tokens, v.committed_ids.view(1, -1)], dim=1)
            committed.extend(new)
        gen.new_tokens = self.finish(committed, max_new_tokens)
        _sync(device)
        gen.seconds = time.perf_counter() - start
        return gen
