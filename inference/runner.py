"""How the decoder runs its step functions: as they are, compiled, or recorded as CUDA graphs, with the reason
logged wherever compiling or recording falls back (``StepRunner``); the decoder (``inference.batch_decoder``) hands
it every step it makes (verify, plain, prefill, a drafter's draft step).

CUDA graphs (``decoder.cuda_graphs``): each bucket's step runs eagerly on a side stream the first time (a real step
that warms up the libraries), is recorded with ``torch.cuda.graph`` the second (graphs share one memory pool) and
replayed from then on; the attention backend is pinned during a decode (no cuDNN attention, whose choice must not
change under a recording); a recording that fails falls back to the eager step, with the reason logged.
``decoder.compile`` compiles the step functions first (inductor's fused kernels; one compilation per step kind,
shared by its capacity buckets, whose key columns are a dynamic size); with graphs on, the compiled step is recorded
the same way (SGLang's pattern: a compiled model under the server's own graphs). ``decoder.compile=auto`` (the
default) compiles on a CUDA target: a graph removes launches, not kernels, and a Hugging Face forward is hundreds of
small kernels that inductor fuses (docs/gpu-decoding.md has the figures).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from inference.generation import sync

log = logging.getLogger(__name__)

CUDA_GRAPHS = ("auto", "on", "off")
COMPILE = ("auto", "on", "off")  # true / false are read as on / off


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



class StepRunner:
    """Runs a decoder's step functions (see the module docstring). ``generator``: the decoder's, which a recorded
    step that samples inside (a static drafter) registers with its graph."""

    def __init__(self, device: torch.device, generator: torch.Generator, cuda_graphs: str = "auto",
                 compile: str | bool = False, compile_backend: str | None = None):
        self.device = device
        self.generator = generator
        self.graphs = resolve_graphs(cuda_graphs, device)
        self.compile = resolve_compile(compile, device)
        self.compile_backend = compile_backend
        self._compiled: dict[tuple, _Compiled] = {}  # one per step kind: every capacity bucket of a state shares it
        self._pool = None
        self.fallback_reason: str | None = None  # why a CUDA graph recording or a compilation fell back
        self.compile_seconds = 0.0  # the first calls of compiled steps (compilation included), all decodes so far
        self._told = False  # the first compilation is announced once
        self.compiled_count = 0  # step functions compiled so far
        # The prompt through a recorded step padded to its capacity bucket where steps are recorded or compiled; on
        # a CPU eagerly over its own columns
        self.static_prefill = self.graphs or self.compile

    def describe(self, fns) -> dict:
        """How the steps ``fns`` ran (reports): CUDA graphs or compile, the step functions made, how many are
        replayed recorded graphs, how many were compiled and the seconds their first calls took (compilation
        included), and why a recording or a compilation fell back (None: none did)."""
        fns = list(fns)
        compiled = {id(c): c for c in map(compiled_of, fns) if c is not None}.values()  # shared by buckets
        return {"cuda_graphs": self.graphs, "compile": self.compile, "step_functions": len(fns),
                "recorded_graphs": sum(isinstance(f, _Recorded) and f.graph is not None for f in fns),
                "compiled_steps": sum(c.seconds is not None for c in compiled),
                "compile_seconds": round(self.compile_seconds, 3),
                "fallback_reason": self.fallback_reason}

    def forget(self, live: set[int]) -> None:
        """Drop the shared compilations of states no longer held (``live``: the ids of those that are)."""
        self._compiled = {k: c for k, c in self._compiled.items() if k[0] in live}

    def wrap(self, fn, label: str, kind: tuple | None = None):
        """``fn`` as the decoder runs a step: compiled, recorded as a CUDA graph, or as it is. ``kind``: the steps
        that share one compilation (every capacity bucket of a step, keyed first by its state's id; None: this step
        alone)."""
        if self.compile:
            compiled = self._compiled.get(kind) if kind is not None else None
            if compiled is None:
                compiled = _Compiled(self._compile(fn, shared=kind is not None), fn, self, label)
                if kind is not None:
                    self._compiled[kind] = compiled
            # On CUDA the compiled step (inductor's fused kernels) is recorded like any other step, as SGLang records
            # its compiled model: compiled on the first, eager call; one graph per bucket after.
            return _Recorded(compiled, self) if self.graphs else compiled
        if self.graphs:
            return _Recorded(fn, self)
        return fn

    def _compile(self, fn, shared: bool):
        """``torch.compile`` of a step: static shapes, except, for a step shared by the capacity buckets, the key
        columns (the cache's bucket view, marked dynamic). Under inductor, the casts to the target's dtype between
        fused operations are kept (``emulate_precision_casts``): a bf16 step then rounds where the eager step rounds,
        so compiled greedy decoding parts from eager decoding only where kernels of other shapes round a near-tie
        apart (``eval.mismatch``), not at every prompt."""
        kw = {"backend": self.compile_backend} if self.compile_backend else {"options": INDUCTOR_OPTIONS}
        use_inductor_cache()
        return torch.compile(_own_code(fn), fullgraph=True, dynamic=None if shared else False, **kw)

    @contextlib.contextmanager
    def pinned(self):
        """The attention backend during a decode: no cuDNN attention on CUDA (see the module docstring)."""
        if self.device.type != "cuda":
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield


class StepClock:
    """Draft and verify time per step. On CUDA, events recorded between the parts, read once after the decode: a
    sync between a step's draft and its verification (the host clock needs one) would stall the device every step,
    and the verification's read-back already waits for both. On a CPU, the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple] = []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step(self, start, drafted, verified) -> None:
        self.marks.append((start, drafted, verified))

    def steps(self) -> list[tuple[float, float]]:
        """(draft seconds, verify seconds) of every step so far; on CUDA after the caller's sync."""
        if self.cuda:
            return [(a.elapsed_time(b) / 1e3, b.elapsed_time(c) / 1e3) for a, b, c in self.marks]
        return [(b - a, c - b) for a, b, c in self.marks]


# Inductor's settings for decode steps (see ``StepRunner._compile``).
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
    logged (``StepRunner.fallback_reason``). A compilation fails before the step runs, so nothing has moved."""

    def __init__(self, compiled, fn, owner: StepRunner, label: str = "step"):
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
    logged (``StepRunner.fallback_reason``)."""

    def __init__(self, fn, owner: StepRunner):
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
