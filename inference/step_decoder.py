"""The batch-1 step decoder: plain and speculative decoding as a sequence of recorded steps over static buffers
(``inference.steps``), the path ``inference.decoder.Decoder`` takes at batch 1.

Per decode: the prompt goes into the static cache (a recorded step per capacity bucket where steps are recorded or
compiled, else eagerly); then per step the host
1. drafts: a drafter with a static step (``static_draft``, ``inference.static_draft``) runs it, writing its own
   ``DraftBuffers`` the verify step reads; any other drafter proposes eagerly (lookup's n-gram search on the host,
   a drafter without a static step) and its tree is copied into the step's fixed buffers, padded with token -1;
2. fills the sampling draws (one ``torch.rand`` into a static buffer: a replayed step draws nothing itself);
3. runs the step of the bucket (width, chain or tree, capacity bucket): eager, compiled (``torch.compile`` with
   ``fullgraph=True``, once per step kind: its capacity buckets share the compilation, the key columns a dynamic
   size, everything else static), or a CUDA graph replay (one recording per bucket);
4. reads the packed verdict back once, and does the host's bookkeeping (committed tokens, EOS, statistics, an eager
   drafter's ``observe`` / ``accepted``).

Batch > 1 runs the same kind of steps with a batch dimension (``inference.batch_steps``, ``inference.batch_decoder``).

CUDA graphs (``decoder.cuda_graphs``): each bucket's step (and a static drafter's draft step) runs eagerly on a side
stream the first time (a real step that warms up the libraries), is recorded with ``torch.cuda.graph`` the second
(graphs share one memory pool) and replayed from then on; the
attention backend is pinned (no cuDNN attention, whose per-shape plans the static shapes would not need anyway but
whose choice must not change under a recording); a recording that fails falls back to the eager step, with the
reason logged. ``decoder.compile`` compiles the step functions first (inductor's fused kernels); with graphs on, the
compiled step is recorded the same way (SGLang's pattern: a compiled model under the server's own graphs).
``decoder.compile=auto`` (the default) compiles on a CUDA target: a graph removes launches, not kernels, and a Hugging
Face forward is hundreds of small kernels that inductor fuses (docs/gpu-decoding.md has the figures).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

import torch
from torch import Tensor

from inference.generation import Generation, check_prompt, check_vocab, finish, prefill_kwargs, sync
from inference.masks import AttentionLayout
from inference.proposer import Proposer
from inference.sampling import SamplingConfig, sample, warp
from inference.static_cache import BUCKET, kv_shapes
from inference.static_draft import weights_signature
from inference.steps import TREE_BUCKET, Bucket, Steps, cut_width, tree_nodes
from inference.tree import DraftTree, raise_bad_parents, raise_bad_tokens

log = logging.getLogger(__name__)

CUDA_GRAPHS = ("auto", "on", "off")
COMPILE = ("auto", "on", "off")  # true / false are read as on / off
MAX_NODES = 64  # the widest draft the fixed buffers hold (a larger tree is refused with the fix)
STATIC_KEPT = 16  # static drafts (and the steps recorded for them) a decoder keeps, oldest dropped first


class NeedsEagerLoop(Exception):
    """A proposal the step path cannot verify (siblings sampled with draft probabilities, walked on the host; a draft
    wider than ``MAX_NODES``): the caller decodes this drafter through the batched steps instead
    (``inference.batch_decoder``, a batch of one), which verify what they can and refuse the rest."""


def resolve_graphs(cuda_graphs: str, device: torch.device) -> bool:
    """``decoder.cuda_graphs`` -> record CUDA graphs or not."""
    if cuda_graphs not in CUDA_GRAPHS:
        raise ValueError(f"decoder.cuda_graphs={cuda_graphs!r}; valid: {list(CUDA_GRAPHS)} (auto: on for CUDA)")
    if cuda_graphs == "on" and device.type != "cuda":
        raise ValueError(f"decoder.cuda_graphs=on needs a CUDA target, but it is on {device.type}; use auto or off")
    return cuda_graphs != "off" and device.type == "cuda"


def compile_setting(compile: str | bool, key: str = "decoder.compile") -> str:
    """``key`` (``decoder.compile``, ``trainer.compile``) as auto / on / off (true and false, as Hydra or Python pass
    them, read as on / off)."""
    value = str(compile).lower()
    value = {"true": "on", "false": "off"}.get(value, value)
    if value not in COMPILE:
        raise ValueError(f"{key}={compile!r}; valid: {list(COMPILE)} (auto: on for a CUDA device; true / "
                         f"false mean on / off)")
    return value


def resolve_compile(compile: str | bool, device: torch.device) -> bool:
    """``decoder.compile`` -> compile the step functions or not (auto: on for a CUDA target, where inductor's fused
    kernels are what a graph replays; on a CPU compiling costs more than a short evaluation saves)."""
    value = compile_setting(compile)
    return value == "on" or (value == "auto" and device.type == "cuda")


def _capacity(columns: int) -> int:
    """Cache capacities are powers of two from ``BUCKET`` up, so a decoder reuses one cache across prompts."""
    c = BUCKET
    while c < columns:
        c *= 2
    return c


class StepDecoder:
    """Batch-1 decoding through ``inference.steps`` (see the module docstring)."""

    def __init__(self, teacher, eos_token_id: int | None, sampling: SamplingConfig, generator: torch.Generator,
                 cuda_graphs: str = "auto", compile: str | bool = False, compile_backend: str | None = None):
        self.teacher = teacher
        self.model = teacher.model
        self.device = teacher.device
        self.eos_token_id = eos_token_id
        self.sampling = sampling
        self.generator = generator
        self.layout = AttentionLayout.of(self.model)
        self.graphs = resolve_graphs(cuda_graphs, self.device)
        self.compile = resolve_compile(compile, self.device)
        self.compile_backend = compile_backend
        self.prefill_kw = prefill_kwargs(self.model)
        self._shapes = None
        self._states: dict[tuple, Steps] = {}
        self._fns: dict[tuple, object] = {}
        self._compiled: dict[tuple, _Compiled] = {}  # one per step kind: every capacity bucket of a state shares it
        self._pool = None
        self._static: dict[tuple, tuple] = {}  # (drafter, buffers, sampling) -> (drafter, its StaticDraft or None)
        self.fallback_reason: str | None = None  # why a CUDA graph recording or a compilation fell back
        self.compile_seconds = 0.0  # the first calls of compiled steps (compilation included), all decodes so far
        self._told = False  # the first compilation is announced once
        self.compiled_count = 0  # step functions compiled so far
        # The prompt through a recorded step padded to its capacity bucket where steps are recorded or compiled; on
        # a CPU eagerly over its own columns (``_prefill``)
        self.static_prefill = self.graphs or self.compile

    def describe(self) -> dict:
        """How the steps ran (reports): CUDA graphs or compile, the step functions made, how many are replayed
        recorded graphs, how many were compiled and the seconds their first calls took (compilation included), and
        why a recording or a compilation fell back (None: none did)."""
        fns = list(self._fns.values())
        compiled = {id(c): c for c in map(compiled_of, fns) if c is not None}.values()  # shared by buckets
        return {"cuda_graphs": self.graphs, "compile": self.compile, "step_functions": len(fns),
                "recorded_graphs": sum(isinstance(f, _Recorded) and f.graph is not None for f in fns),
                "compiled_steps": sum(c.seconds is not None for c in compiled),
                "compile_seconds": round(self.compile_seconds, 3),
                "fallback_reason": self.fallback_reason}

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
            live = {id(s) for s in self._states.values()}  # what a replaced state's recordings held goes with it
            self._static = {k: v for k, v in self._static.items() if k[1] in live}
            drafts = {("draft", id(v[1])) for v in self._static.values()}
            self._fns = {k: f for k, f in self._fns.items() if k[0] in live or k[:2] in drafts}
            self._compiled = {k: c for k, c in self._compiled.items() if k[0] in live}
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
        # A step reads its key columns from the cache (``StaticKV.bucket``), never from ``bucket.columns``: the
        # step of one kind is the same function, compiled once, at every capacity bucket.
        shape = Bucket(bucket.nodes, bucket.chain, 0)
        if bucket.nodes == 0:
            fn, label = functools.partial(steps.plain, sampling), "plain step"
        else:
            fn = functools.partial(steps.verify, shape, sampling)
            label = f"verify step ({bucket.nodes}-node {'chain' if bucket.chain else 'tree'})"
        return self._wrap(fn, label, (id(steps), shape, sampling, id(steps.draft)))

    def _wrap(self, fn, label: str, kind: tuple | None = None):
        """``fn`` as this decoder runs a step: compiled, recorded as a CUDA graph, or as it is. ``kind``: the steps
        that share one compilation (every capacity bucket of a step; None: this step alone)."""
        if self.compile:
            compiled = self._compiled.get(kind) if kind is not None else None
            if compiled is None:
                compiled = _Compiled(self._compile(fn, shared=kind is not None), fn, self, label)
                if kind is not None:
                    self._compiled[kind] = compiled
            # On CUDA the compiled step (inductor's fused kernels) is recorded by this decoder like any other step, as
            # SGLang records its compiled model: compiled on the first, eager call; one graph per bucket after.
            return _Recorded(compiled, self) if self.graphs else compiled
        if self.graphs:
            return _Recorded(fn, self)
        return fn

    def _compile(self, fn, shared: bool):
        """``torch.compile`` of a step: static shapes, except, for a step shared by the capacity buckets, the key
        columns (``StaticKV.bucket``, marked dynamic). Under inductor, the casts to the target's dtype between fused
        operations are kept (``emulate_precision_casts``): a bf16 step then rounds where the eager step rounds, so
        compiled greedy decoding parts from eager decoding only where kernels of other shapes round a near-tie
        apart (``eval.mismatch``), not at every prompt."""
        kw = {"backend": self.compile_backend} if self.compile_backend else {"options": INDUCTOR_OPTIONS}
        use_inductor_cache()
        return torch.compile(_own_code(fn), fullgraph=True, dynamic=None if shared else False, **kw)

    def _prefill(self, steps: Steps, prompt: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """The prompt into the cache: (last logits [V], hidden states {layer: [P, D]}). Recorded or compiled like a
        step, one per capacity bucket, where steps are (graphs, compile); else eager over the prompt's own columns
        (on a CPU, attention over a whole bucket would cost more than it saves)."""
        if not self.static_prefill:
            return steps.prefill(prompt, self.prefill_kw)
        P = prompt.shape[0]
        B = steps.load_prompt(prompt)
        key = (id(steps), "prefill", B)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self._wrap(functools.partial(steps.prefill_bucket, B, self.prefill_kw),
                                             f"prefill ({B} columns)")
        fn()
        steps.cache.host_length = P
        return steps.first_logits.clone(), {i: h[:P].clone() for i, h in steps.prefill_hidden[B].items()}

    def _draft_step(self, static, shape: tuple | None = None):
        """The static drafter's ``draft`` as this decoder runs a step (recorded / compiled like the verify steps), one
        per shape the drafter chose (``inference.static_draft.ShapedDraft``; None: a draft step of one shape)."""
        key = ("draft", id(static), shape)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self._wrap(static.draft, f"draft step ({type(static).__name__})")
        return fn

    @contextlib.contextmanager
    def _pinned(self):
        """The attention backend during a decode: no cuDNN attention on CUDA (see the module docstring)."""
        if self.device.type != "cuda":
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield

    def _static_draft(self, drafter: Proposer, steps: Steps, sampling: SamplingConfig):
        """The drafter's static step for these buffers, or None. Asked of the drafter at every sequence: the drafter
        keeps one per buffers and decode settings (``Drafter.reuse_static_draft``), so the same settings get the same
        object (and the step recorded for it) while a new tree budget, depth or cast gets a new one. The decoder keeps
        what it was handed so the steps recorded for it are dropped with the buffers they write (``state``)."""
        if not hasattr(drafter, "static_draft"):
            return None
        static = drafter.static_draft(steps.committed, steps.cache.capacity, sampling, self.generator)
        key = (id(drafter), id(steps), sampling, weights_signature(drafter), id(static))
        if key not in self._static:
            if len(self._static) >= STATIC_KEPT:  # the oldest goes, with the steps recorded for it
                old = self._static.pop(next(iter(self._static)))
                gone = ("draft", id(old[1]))
                self._fns = {k: f for k, f in self._fns.items() if k[:2] != gone}
            self._static[key] = (drafter, static)
        return static

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
        check_prompt(prompt_ids, max_new_tokens, 0, self.teacher.max_positions)
        sync(self.device)
        start, compiled = time.perf_counter(), self.compile_seconds
        with self._pinned():
            run = self.session(None, prompt_ids, max_new_tokens, 0, sampling)
            while len(run.new) < max_new_tokens and run.new[-1] != self.eos_token_id:
                run.plain_step()
        sync(self.device)
        compiling = self.compile_seconds - compiled
        return Generation(new_tokens=finish(run.new, max_new_tokens, self.eos_token_id),
                          seconds=time.perf_counter() - start - compiling, compile_seconds=compiling)

    @torch.no_grad()
    def speculative(self, drafter: Proposer, prompt_ids: Tensor, max_new_tokens: int, num_draft: int,
                    sampling: SamplingConfig | None = None) -> Generation:
        check_vocab(drafter, self.teacher.vocab_size)
        check_prompt(prompt_ids, max_new_tokens, num_draft, self.teacher.max_positions)
        if num_draft < 1:
            return self.plain(prompt_ids, max_new_tokens, sampling)
        sync(self.device)
        start, compiled = time.perf_counter(), self.compile_seconds
        with self._pinned():
            run = self.session(drafter, prompt_ids, max_new_tokens, num_draft, sampling)
            sync(self.device)
            gen = run.gen
            prefilled = self.compile_seconds
            gen.prefill_seconds = time.perf_counter() - start - (prefilled - compiled)
            clock = StepClock(self.device)
            drafting = 0.0  # compilation inside draft steps (the rest of it is inside verify steps)
            while len(run.new) < max_new_tokens and (self.eos_token_id is None or self.eos_token_id not in run.new):
                t0 = clock.mark()
                before = self.compile_seconds
                run.draft(min(num_draft, max_new_tokens - len(run.new)))
                drafting += self.compile_seconds - before
                t1 = clock.mark()
                run.verify()
                clock.step(t0, t1, clock.mark())
        sync(self.device)
        gen.compile_seconds = self.compile_seconds - compiled
        draft_s, verify_s = clock.totals()
        gen.draft_seconds = draft_s - drafting
        gen.verify_seconds = verify_s - (self.compile_seconds - prefilled - drafting)
        gen.seconds = time.perf_counter() - start - gen.compile_seconds
        gen.new_tokens = finish(run.new, max_new_tokens, self.eos_token_id)
        return gen

    def session(self, drafter: Proposer | None, prompt_ids: Tensor, max_new_tokens: int, num_draft: int,
                sampling: SamplingConfig | None = None) -> "Session":
        """A sequence prefilled and ready to step (``Session``): room for ``max_new_tokens`` committed tokens; a
        drafter (None: plain steps only) drafting at most ``num_draft`` deep. The caller pins the attention backend
        (``_pinned``) around the decode."""
        sampling = sampling or self.sampling
        P = prompt_ids.shape[1]
        if drafter is None:
            steps = self.state(P + max_new_tokens + 1)
            return Session(self, steps, None, None, prompt_ids, sampling, 0, max_new_tokens)
        steps = self.state(P + max_new_tokens + MAX_NODES + 1, tuple(drafter.teacher_layers), MAX_NODES,
                           1 + num_draft, not sampling.greedy)
        static = self._static_draft(drafter, steps, sampling)
        steps.use_draft(static.buffers if static is not None else None)
        if static is not None:
            T = static.buffers.tokens_T.shape[0]
            if T > MAX_NODES:
                raise NeedsEagerLoop(f"drafter {drafter.name!r} drafts {T} nodes per step, more than the step "
                                     f"decoder's {MAX_NODES}")
            steps.cache.declare(1 + T)
        return Session(self, steps, drafter, static, prompt_ids, sampling, num_draft, max_new_tokens)

    def _load(self, steps: Steps, tree: DraftTree, num_draft: int, sampling: SamplingConfig,
              variable_depth: bool = False):
        """An eager proposal into the step's fixed draft buffers: (bucket nodes, real nodes, chain, parents).
        ``variable_depth``: the drafter cuts its own chains (``Proposer.variable_depth``)."""
        n, chain = tree.size, tree.is_chain
        if tree.probs_NV is not None and not chain and not sampling.greedy:
            raise NeedsEagerLoop("siblings sampled with draft probabilities are walked on the host")
        if not chain:
            N = tree_nodes(n)
        elif variable_depth:
            N = cut_width(n, num_draft)  # a chain the drafter cut: its own bucket
        else:
            N = num_draft if n else 0  # an empty chain: a plain step (which hands a drafter its committed row)
        if max(n, N) > steps.max_nodes:
            raise NeedsEagerLoop(f"a proposal of {n} nodes is wider than the step decoder's {steps.max_nodes}")
        if not chain and n and _deepest(tree) > steps.max_depth:  # the step's geometry reaches no deeper
            raise NeedsEagerLoop(f"a tree deeper than the step decoder's {steps.max_depth} levels")
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


class Session:
    """One sequence on a ``StepDecoder``'s buffers: prefilled at construction, then ``plain_step``, or ``draft``
    followed by ``verify``, each one step of the real loop on the moving context (what ``inference.cost`` times)."""

    def __init__(self, dec: StepDecoder, steps: Steps, drafter: Proposer | None, static, prompt_ids: Tensor,
                 sampling: SamplingConfig, num_draft: int, max_new_tokens: int):
        self.dec, self.steps, self.drafter, self.static = dec, steps, drafter, static
        self.sampling, self.num_draft = sampling, num_draft
        self.vocab = dec.teacher.vocab_size
        self.gen = Generation(new_tokens=[], seconds=0.0)
        P = prompt_ids.shape[1]
        prompt = prompt_ids[0].to(dec.device)
        logits, hidden = dec._prefill(steps, prompt)
        nxt = dec._first(logits, sampling)
        steps.pending.copy_(nxt[0])
        steps.committed.pending.copy_(nxt[0])
        self.new = [int(nxt)]
        self.seq = torch.empty(1, P + max_new_tokens + MAX_NODES + 1, dtype=torch.long, device=dec.device)
        self.seq[0, :P].copy_(prompt)
        self.seq[0, P].copy_(nxt[0])
        self.m = P + 1
        self.static_parents = None
        self._next = None  # (bucket, size, chain, parents, tree) of the drafted proposal
        if static is not None:
            static.prefill(prompt, hidden, steps.pending)
            if not static.buffers.chain:
                self.static_parents = static.buffers.parents_T.cpu()
        elif drafter is not None:
            drafter.reset(int(torch.randint(0, 2**62, (1,), generator=dec.generator, device=dec.device)))
            drafter.observe({i: h[None] for i, h in hidden.items()})

    def plain_step(self) -> int:
        """One plain step: the next token (read back)."""
        steps = self.steps
        self.dec._step(steps, self.dec._bucket(steps, 0, True), self.sampling)
        token = int(steps.out[3])  # the step's one read-back
        steps.cache.host_length += 1
        self.new.append(token)
        return token

    def draft(self, depth: int) -> None:
        """The drafter's proposal for the next ``verify``: its static step, or an eager proposal of at most
        ``depth`` (copied into the step's buffers)."""
        dec, steps = self.dec, self.steps
        if self.static is not None:
            steps.use_draft(self.static.buffers)
            use_shape = getattr(self.static, "use_shape", None)  # context: the pending token's position
            shape = use_shape(steps.cache.host_length, True) if use_shape else None
            dec._draft_step(self.static, shape)()
            b = self.static.buffers
            T = size = b.tokens_T.shape[0]
            if b.chain and depth < T:  # no deeper than ``depth``, as an eager proposal
                b.tokens_T[depth:].fill_(-1)  # never accepted; the next draft rewrites them
                size = depth
            elif not b.chain and depth < self.num_draft:  # near the end: a tree no deeper than the tokens left
                clip_tree(b, depth)
            N = T
            kept = getattr(self.static, "kept", None)
            if kept is not None and b.chain:  # a cutting drafter: verify its cut's bucket (one read-back more)
                N = cut_width(min(int(kept), size), T)
                size = min(size, N)
            self._next = (dec._bucket(steps, N, b.chain), size, b.chain, self.static_parents, None)
            return
        tree = self.drafter.propose(self.seq[:, : self.m], depth, self.sampling)
        tree.check_shape(self.vocab)
        N, size, chain, parents = dec._load(steps, tree, self.num_draft, self.sampling,
                                            getattr(self.drafter, "variable_depth", False))
        self._next = (dec._bucket(steps, N, chain), size, chain, parents, tree)

    def load(self, tree: DraftTree, num_draft: int | None = None) -> None:
        """Verify ``tree`` next instead of a drafted proposal (the cost model's random trees of a shape), a chain in
        the bucket of a decode drafting ``num_draft`` (default: this session's). A static drafter's next catch-up
        still feeds only what follows its own last draft (the step a real decode runs, which the cost model times),
        so that draft reads a cache without this tree's tokens: a poorer guess, never a wrong output."""
        N, size, chain, parents = self.dec._load(self.steps, tree, num_draft or self.num_draft, self.sampling)
        self.steps.use_draft(None)
        self._next = (self.dec._bucket(self.steps, N, chain), size, chain, parents, tree)

    def verify(self) -> tuple[list[int], list[int]]:
        """Verify the proposal: (accepted path, committed tokens); the drafter is handed the committed rows."""
        dec, steps, gen = self.dec, self.steps, self.gen
        bucket, size, chain, parents, tree = self._next
        context = steps.cache.host_length
        dec._step(steps, bucket, self.sampling)
        N = bucket.nodes
        values = steps.out[: bucket.packed].tolist()  # the step's one read-back
        count, depth_seen, flags = values[:3]
        if flags:
            dec._raise(flags, tree if tree is not None else DraftTree(
                steps.draft.tokens_T.clone(), steps.draft.parents_T.clone()), self.vocab)
        path, committed = values[3: 3 + count], values[3 + N: 4 + N + count]
        steps.cache.host_length += 1 + count
        self.seq[0, self.m: self.m + 1 + count].copy_(steps.out[3 + N: 4 + N + count])
        self.m += 1 + count
        gen.stats.update(size if chain else depth_seen, count)
        gen.nodes_per_forward[size] += 1
        gen.verified_positions += bucket.width
        if size not in gen.shapes:
            gen.shapes[size] = torch.arange(-1, size - 1) if chain else parents[:size].cpu()
        gen.node_accepts[size].update(path)
        gen.context_tokens += context + 1
        if self.static is None and self.drafter is not None:
            c = steps.committed
            self.drafter.observe({i: h[: 1 + count].clone()[None] for i, h in c.hidden_M.items()})
            self.drafter.accepted(path, committed)
        self.new.extend(committed)
        return path, committed


class StepClock:
    """Draft and verify time over a decode. On CUDA, events recorded between the parts, read once after the decode: a
    sync between a step's draft and its verification (the host clock needs one) would stall the device every step,
    and the verification's read-back already waits for both. On a CPU, the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple] = []
        self.draft = self.verify = 0.0

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step(self, start, drafted, verified) -> None:
        if self.cuda:
            self.marks.append((start, drafted, verified))
        else:
            self.draft += drafted - start
            self.verify += verified - drafted

    def totals(self) -> tuple[float, float]:
        """(draft seconds, verify seconds); on CUDA after the caller's sync."""
        for start, drafted, verified in self.marks:
            self.draft += start.elapsed_time(drafted) / 1e3
            self.verify += drafted.elapsed_time(verified) / 1e3
        self.marks.clear()
        return self.draft, self.verify


def _deepest(tree: DraftTree) -> int:
    """A bound on the tree's depth: the drafter's own (no read-back), else measured on the host."""
    return tree.depth_bound if tree.depth_bound is not None else tree.depth


def clip_tree(buffers, depth: int) -> None:
    """Nodes of a static draft's tree deeper than ``depth`` (a root child has depth 1) get token -1, which is never
    accepted: the step's bucket stays, the accepted path stays within the tokens a decode still needs. On the
    device, ``depth - 1`` gathers; the next draft rewrites every node."""
    parents = buffers.parents_T
    up = parents.clone()  # each node's ancestor 1, then 2, ... levels up (-1 once past a root child)
    for _ in range(depth - 1):
        up = torch.where(up >= 0, parents[up.clamp(min=0)], up)
    buffers.tokens_T.masked_fill_(up >= 0, -1)  # still below a node after ``depth`` levels: deeper than ``depth``


# Inductor's settings for decode steps (see ``StepDecoder._compile``).
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def inductor_cache_dir() -> str:
    """Where inductor keeps what it compiled (its FX graph and autotuning caches), so a later run on the machine
    loads kernels instead of compiling them again: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else ``inductor`` under
    this project's cache (``$SPECDRAFT_CACHE``, default ``~/.cache/specdraft``), beside the toy targets."""
    root = os.environ.get("SPECDRAFT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdraft")
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(root, "inductor")


def use_inductor_cache() -> None:
    """Point inductor at ``inductor_cache_dir()`` (once, before the first compilation; a set
    ``$TORCHINDUCTOR_CACHE_DIR`` is kept)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())


def _own_code(fn):
    """``fn`` called from a function with a code object of its own. Dynamo keeps compiled graphs per code object and
    gives up on one past ``torch._dynamo.config.recompile_limit`` (8) of them; every step (a ``functools.partial`` or
    a static drafter's bound ``draft``) would otherwise share one code object (the wrapper ``torch.compile`` puts
    around a partial, or the drafter class's ``draft``), so a decoder's ninth bucket or a second drafter's draft step
    would fail to compile and run uncompiled."""

    def step():
        return fn()

    step.__code__ = step.__code__.replace()  # a new code object (the function's own is shared by every ``step``)
    return step


def compiled_of(fn) -> "_Compiled | None":
    """The compiled step a step function runs (itself, or the one under its CUDA graph); None: an uncompiled step."""
    fn = fn.fn if isinstance(fn, _Recorded) else fn
    return fn if isinstance(fn, _Compiled) else None


class _Compiled:
    """A compiled step whose compilation, on its first call, may fail: the step then runs as it is, with the reason
    logged (``StepDecoder.fallback_reason``). A compilation fails before the step runs, so nothing has moved."""

    def __init__(self, compiled, fn, owner: StepDecoder, label: str = "step"):
        self.compiled, self.fn, self.owner, self.calls, self.label = compiled, fn, owner, 0, label
        self.seconds: float | None = None  # the first call's, compilation included (None: not compiled)

    def __call__(self) -> None:
        self.calls += 1
        if self.calls > 1:
            self.compiled()
            return
        owner = self.owner
        if not owner._told:
            owner._told = True
            log.info("decoder.compile: each step kind compiles on its first use (about 20 s on an H200 for a 1B "
                     "target; inductor's cache: %s); decoder.compile=off skips it (docs/gpu-decoding.md)",
                     os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        start = time.perf_counter()
        try:
            self.compiled()
        except Exception as e:  # noqa: BLE001 - any failure to compile: decode with the step as it is, and say why
            owner.fallback_reason = f"compile: {type(e).__name__}: {e}"[:2000]
            log.warning("compiling a decode step failed (%s); it runs uncompiled", owner.fallback_reason)
            self.compiled = self.fn
            self.fn()
            return
        sync(owner.device)  # once per compiled step: its first call's time is the compilation's
        self.seconds = time.perf_counter() - start
        owner.compile_seconds += self.seconds
        owner.compiled_count += 1
        log.info("decoder.compile: %s compiled in %.1f s (%d steps, %.1f s so far)", self.label, self.seconds,
                 owner.compiled_count, owner.compile_seconds)


class _Recorded:
    """A step as a CUDA graph. Its first call runs it eagerly on a side stream (a real step, which also warms up
    every library it touches, as a recording needs); its second records it (recording runs nothing, so no decode
    state moves) and replays it; later calls replay. A recording that fails leaves the step eager, with the reason
    logged (``StepDecoder.fallback_reason``)."""

    def __init__(self, fn, owner: StepDecoder):
        self.fn, self.owner, self.calls, self.graph, self.failed = fn, owner, 0, None, False

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        self.calls += 1
        if self.failed:
            self.fn()
        elif self.calls == 1:
            device = self.owner.device
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self.fn()
            torch.cuda.current_stream(device).wait_stream(stream)
        else:
            try:
                graph = torch.cuda.CUDAGraph()
                if hasattr(graph, "register_generator_state"):  # a static drafter may sample inside its step
                    graph.register_generator_state(self.owner.generator)
                if self.owner._pool is None:
                    self.owner._pool = torch.cuda.graph_pool_handle()
                with torch.cuda.graph(graph, pool=self.owner._pool):
                    self.fn()
            except Exception as e:  # noqa: BLE001 - any failure to record: decode eagerly, and say why
                self.failed = True
                self.owner.fallback_reason = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph recording of a decode step failed (%s); it runs eagerly",
                            self.owner.fallback_reason)
                self.fn()
                return
            self.graph = graph
            graph.replay()


__all__ = ["StepDecoder", "Session", "NeedsEagerLoop", "resolve_graphs", "resolve_compile", "compile_setting",
           "compiled_of", "CUDA_GRAPHS", "COMPILE", "TREE_BUCKET"]
