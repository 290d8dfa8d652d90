"""The batch-1 step decoder: plain and speculative decoding as a sequence of recorded steps over static buffers
(``inference.steps``), the path ``inference.decoder.Decoder`` takes at batch 1.

Per decode: the prompt runs eagerly into the static cache; then per step the host
1. drafts: a drafter with a static step (``static_draft``, ``inference.static_draft``) runs it, writing its own
   ``DraftBuffers`` the verify step reads; any other drafter proposes eagerly (lookup's n-gram search on the host,
   a drafter without a static step) and its tree is copied into the step's fixed buffers, padded with token -1;
2. fills the sampling draws (one ``torch.rand`` into a static buffer: a replayed step draws nothing itself);
3. runs the step of the bucket (width, chain or tree, capacity bucket): eager, ``torch.compile(fullgraph=True,
   dynamic=False)``, or a CUDA graph replay;
4. reads the packed verdict back once, and does the host's bookkeeping (committed tokens, EOS, statistics, an eager
   drafter's ``observe`` / ``accepted``).

Batch > 1 stays on the eager ``inference.batched.BatchedDecoder`` (batch buckets come later).

CUDA graphs (``decoder.cuda_graphs``): each bucket's step is recorded with ``torch.cuda.graph`` on first use (one
eager warm-up, decode state restored around it, graphs sharing one memory pool) and replayed afterwards; the
attention backend is pinned (no cuDNN attention, whose per-shape plans the static shapes would not need anyway but
whose choice must not change under a recording); a recording that fails falls back to the eager step, with the
reason logged. ``decoder.compile`` compiles the step functions instead (``mode="reduce-overhead"`` on CUDA).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch
from torch import Tensor

from inference.generation import Generation, check_prompt, check_vocab, finish, prefill_kwargs, sync
from inference.masks import AttentionLayout
from inference.proposer import Proposer
from inference.sampling import SamplingConfig, sample, warp
from inference.static_cache import BUCKET, kv_shapes
from inference.steps import TREE_BUCKET, Bucket, Steps, tree_nodes
from inference.tree import DraftTree, raise_bad_parents, raise_bad_tokens

log = logging.getLogger(__name__)

CUDA_GRAPHS = ("auto", "on", "off")
MAX_NODES = 64  # the widest draft the fixed buffers hold (a larger tree is refused with the fix)


class NeedsEagerLoop(Exception):
    """A proposal the step path cannot verify exactly (siblings sampled with draft probabilities): the caller decodes
    this drafter with the eager loop instead."""


def resolve_graphs(cuda_graphs: str, device: torch.device) -> bool:
    """``decoder.cuda_graphs`` -> record CUDA graphs or not."""
    if cuda_graphs not in CUDA_GRAPHS:
        raise ValueError(f"decoder.cuda_graphs={cuda_graphs!r}; valid: {list(CUDA_GRAPHS)} (auto: on for CUDA)")
    if cuda_graphs == "on" and device.type != "cuda":
        raise ValueError(f"decoder.cuda_graphs=on needs a CUDA target, but it is on {device.type}; use auto or off")
    return cuda_graphs != "off" and device.type == "cuda"


def _capacity(columns: int) -> int:
    """Cache capacities are powers of two from ``BUCKET`` up, so a decoder reuses one cache across prompts."""
    c = BUCKET
    while c < columns:
        c *= 2
    return c


class StepDecoder:
    """Batch-1 decoding through ``inference.steps`` (see the module docstring)."""

    def __init__(self, teacher, eos_token_id: int | None, sampling: SamplingConfig, generator: torch.Generator,
                 cuda_graphs: str = "auto", compile: bool = False, compile_backend: str | None = None):
        self.teacher = teacher
        self.model = teacher.model
        self.device = teacher.device
        self.eos_token_id = eos_token_id
        self.sampling = sampling
        self.generator = generator
        self.layout = AttentionLayout.of(self.model)
        self.graphs = resolve_graphs(cuda_graphs, self.device)
        self.compile = compile
        self.compile_backend = compile_backend
        self.prefill_kw = prefill_kwargs(self.model)
        self._shapes = None
        self._states: dict[tuple, Steps] = {}
        self._fns: dict[tuple, object] = {}
        self._pool = None
        self.fallback_reason: str | None = None  # why a CUDA graph recording fell back to the eager step

    # --- state and step functions ----------------------------------------------------------------------------------
    def state(self, columns: int, layers: tuple[int, ...] = (), max_nodes: int = 0, rows: int = 1,
              probs: bool = False) -> Steps:
        """The buffers for a decode needing ``columns`` cache columns (built once per shape, reused afterwards)."""
        key = (tuple(layers), max_nodes, rows, probs)
        steps = self._states.get(key)
        if steps is None or steps.cache.capacity < columns:
            if self._shapes is None:
                self._shapes = kv_shapes(self.model)
            hf = {i: self.teacher.resolve_layer(i) for i in layers}
            steps = Steps(self.model, self.layout, _capacity(columns), self.teacher.vocab_size, hf, max_nodes, rows,
                          probs=probs, shapes=self._shapes)
            self._states[key] = steps
            self._fns = {k: f for k, f in self._fns.items() if k[0] != key}
        return steps

    def _step(self, steps: Steps, bucket: Bucket, sampling: SamplingConfig) -> None:
        steps.cache.bucket = bucket.columns
        if not sampling.greedy:
            torch.rand(steps.uniforms.shape, generator=self.generator, device=self.device, out=steps.uniforms)
        key = (id(steps), bucket, sampling, id(steps.draft))
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self._make(steps, bucket, sampling)
        fn()

    def _make(self, steps: Steps, bucket: Bucket, sampling: SamplingConfig):
        fn = (functools.partial(steps.plain, sampling) if bucket.nodes == 0
              else functools.partial(steps.verify, bucket, sampling))
        if self.compile:
            kw = {"backend": self.compile_backend} if self.compile_backend else {}
            if self.device.type == "cuda" and not self.compile_backend:
                kw["mode"] = "reduce-overhead"
            return torch.compile(fn, fullgraph=True, dynamic=False, **kw)
        if self.graphs:
            return self._record(steps, fn)
        return fn

    def _record(self, steps: Steps, fn):
        """A CUDA graph of ``fn``: one eager warm-up on a side stream, then the recording; the decode state the
        step advances is restored around both, so the first real step is the first replay."""
        c = steps.committed
        state = [steps.cache.length, steps.pending, steps.out, c.ids_M, c.count, c.position, c.pending,
                 *c.hidden_M.values()]
        saved = [t.clone() for t in state]

        def restore():
            for t, s in zip(state, saved):
                t.copy_(s)

        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            restore()
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                fn()
            restore()
        except Exception as e:  # noqa: BLE001 - any failure to record: decode eagerly, and say why
            restore()
            self.fallback_reason = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph recording of a decode step failed (%s); this step runs eagerly",
                        self.fallback_reason)
            return fn
        return graph.replay

    @contextlib.contextmanager
    def _pinned(self):
        """The attention backend during a decode: no cuDNN attention on CUDA (see the module docstring)."""
        if self.device.type != "cuda":
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield

    def _first(self, logits_V: Tensor, sampling: SamplingConfig) -> Tensor:
        if sampling.greedy:
            return logits_V.argmax(-1, keepdim=True)
        return sample(warp(logits_V[None], sampling), self.generator)

    def _bucket(self, steps: Steps, nodes: int, chain: bool) -> Bucket:
        width = 1 + nodes
        return Bucket(nodes, chain, steps.cache.use_bucket(steps.cache.host_length + width))

    # --- decoding --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def plain(self, prompt_ids: Tensor, max_new_tokens: int, sampling: SamplingConfig | None = None) -> Generation:
        sampling = sampling or self.sampling
        check_prompt(prompt_ids, max_new_tokens, 0, self.teacher.max_positions)
        P = prompt_ids.shape[1]
        steps = self.state(P + max_new_tokens + 1)
        sync(self.device)
        start = time.perf_counter()
        with self._pinned():
            logits, _ = steps.prefill(prompt_ids[0].to(self.device), self.prefill_kw)
            nxt = self._first(logits, sampling)
            steps.pending.copy_(nxt[0])
            out = [int(nxt)]
            while len(out) < max_new_tokens and out[-1] != self.eos_token_id:
                self._step(steps, self._bucket(steps, 0, True), sampling)
                out.append(int(steps.out[3]))  # the step's one read-back
                steps.cache.host_length += 1
        sync(self.device)
        return Generation(new_tokens=finish(out, max_new_tokens, self.eos_token_id),
                          seconds=time.perf_counter() - start)

    @torch.no_grad()
    def speculative(self, drafter: Proposer, prompt_ids: Tensor, max_new_tokens: int, num_draft: int,
                    sampling: SamplingConfig | None = None) -> Generation:
        sampling = sampling or self.sampling
        check_vocab(drafter, self.teacher.vocab_size)
        check_prompt(prompt_ids, max_new_tokens, num_draft, self.teacher.max_positions)
        if num_draft < 1:
            return self.plain(prompt_ids, max_new_tokens, sampling)
        P, vocab = prompt_ids.shape[1], self.teacher.vocab_size
        layers = tuple(drafter.teacher_layers)
        probs = not sampling.greedy
        steps = self.state(P + max_new_tokens + MAX_NODES + 1, layers, MAX_NODES, 1 + num_draft, probs)
        static = drafter.static_draft(steps.committed, steps.cache.capacity, sampling, self.generator) \
            if hasattr(drafter, "static_draft") else None
        steps.use_draft(static.buffers if static is not None else None)
        if static is not None:
            T = static.buffers.tokens_T.shape[0]
            if T > MAX_NODES:
                raise ValueError(f"drafter {drafter.name!r} drafts {T} nodes per step; the step decoder holds at most "
                                 f"{MAX_NODES}: lower its total_tokens")
            steps.cache.positions(1 + T)
            static_parents = None if static.buffers.chain else static.buffers.parents_T.cpu()
        gen = Generation(new_tokens=[], seconds=0.0)
        sync(self.device)
        start = time.perf_counter()
        with self._pinned():
            logits, hidden = steps.prefill(prompt_ids[0].to(self.device), self.prefill_kw)
            nxt = self._first(logits, sampling)
            steps.pending.copy_(nxt[0])
            new = [int(nxt)]
            seq = torch.empty(1, P + max_new_tokens + MAX_NODES + 1, dtype=torch.long, device=self.device)
            seq[0, :P].copy_(prompt_ids[0])
            seq[0, P].copy_(nxt[0])
            m = P + 1
            if static is not None:
                static.prefill(prompt_ids[0].to(self.device), hidden, steps.pending)
            else:
                drafter.reset(int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device)))
                drafter.observe({i: h[None] for i, h in hidden.items()})
            sync(self.device)
            gen.prefill_seconds = time.perf_counter() - start
            while len(new) < max_new_tokens and (self.eos_token_id is None or self.eos_token_id not in new):
                t0 = time.perf_counter()
                if static is not None:
                    static.draft()
                    T, chain, parents = static.buffers.tokens_T.shape[0], static.buffers.chain, static_parents
                    bucket, size = self._bucket(steps, T, chain), T
                    tree = None
                    left = max_new_tokens - len(new)
                    if chain and left < T:  # no deeper than the tokens still wanted, as an eager proposal
                        static.buffers.tokens_T[left:].fill_(-1)  # never accepted; the next draft rewrites them
                        size = left
                else:
                    depth = min(num_draft, max_new_tokens - len(new))
                    tree = drafter.propose(seq[:, :m], depth, sampling)
                    tree.check_shape(vocab)
                    N, size, chain, parents = self._load(steps, tree, num_draft, sampling)
                    bucket = self._bucket(steps, N, chain)
                sync(self.device)
                t1 = time.perf_counter()
                context = steps.cache.host_length
                self._step(steps, bucket, sampling)
                values = steps.out[: bucket.packed].tolist()  # the step's one read-back
                count, depth_seen, flags = values[:3]
                N = bucket.nodes
                if flags:
                    self._raise(flags, tree if tree is not None else DraftTree(
                        static.buffers.tokens_T.clone(), static.buffers.parents_T.clone()), vocab)
                path, committed = values[3: 3 + count], values[3 + N: 4 + N + count]
                steps.cache.host_length += 1 + count
                seq[0, m: m + 1 + count].copy_(steps.out[3 + N: 4 + N + count])
                m += 1 + count
                gen.stats.update(size if chain else depth_seen, count)
                gen.nodes_per_forward[size] += 1
                if size not in gen.shapes:
                    gen.shapes[size] = (torch.arange(-1, size - 1) if chain else parents[:size].cpu())
                gen.node_accepts[size].update(path)
                gen.context_tokens += context + 1
                if static is None:
                    c = steps.committed
                    drafter.observe({i: h[: 1 + count].clone()[None] for i, h in c.hidden_M.items()})
                    drafter.accepted(path, committed)
                new.extend(committed)
                sync(self.device)
                t2 = time.perf_counter()
                gen.draft_seconds += t1 - t0
                gen.verify_seconds += t2 - t1
        sync(self.device)
        gen.seconds = time.perf_counter() - start
        gen.new_tokens = finish(new, max_new_tokens, self.eos_token_id)
        return gen

    def _load(self, steps: Steps, tree: DraftTree, num_draft: int, sampling: SamplingConfig):
        """An eager proposal into the step's fixed draft buffers: (bucket nodes, real nodes, chain, parents)."""
        n, chain = tree.size, tree.is_chain
        if tree.probs_NV is not None and not chain and not sampling.greedy:
            raise NeedsEagerLoop("siblings sampled with draft probabilities are walked on the host")
        N = num_draft if chain else tree_nodes(n)
        if max(n, N) > steps.max_nodes:
            raise ValueError(f"a proposal of {n} nodes exceeds the step decoder's {steps.max_nodes}: lower the "
                             f"drafter's tree size (total_tokens / decoder.tree) or eval.num_draft")
        d = steps.own_draft
        if n:
            d.tokens_T[:n].copy_(tree.tokens)
        d.tokens_T[n:N].fill_(-1)
        if not chain:
            if n:
                d.parents_T[:n].copy_(tree.parents)
            d.parents_T[n:N].fill_(-1)
        if d.probs_TV is not None and chain:
            if tree.probs_NV is not None and n:
                d.probs_TV[:n].copy_(tree.probs_NV)
                d.probs_TV[n:N].zero_()
            else:
                d.probs_TV[:N].zero_()
                if n:  # point masses: q(x) = 1 on each drafted token
                    d.probs_TV[:n].scatter_(1, tree.tokens.view(-1, 1).clamp(0, d.probs_TV.shape[1] - 1), 1.0)
        return N, n, chain, (None if chain else tree.parents)

    @staticmethod
    def _raise(flags: int, tree: DraftTree, vocab: int):
        if flags & 2:
            raise_bad_parents(tree.parents)
        raise_bad_tokens(tree.tokens, vocab)


__all__ = ["StepDecoder", "NeedsEagerLoop", "resolve_graphs", "CUDA_GRAPHS", "TREE_BUCKET"]
