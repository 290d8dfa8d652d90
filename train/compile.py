"""``trainer.compile``: the training step's regions compiled by ``torch.compile`` (regional compilation).

A whole training step does not fit one graph: the chunked loss is a hand-written autograd function with a Python
loop over chunks, the engines wrap the drafter in hooks, and transformers' own forwards carry hooks dynamo cannot
trace. What costs time between those pieces is dense and static: each drafter layer (projections, rotary
embedding, norms, the MLP, the attention kernel) and each loss chunk's softmax / divergence / gradient arithmetic.
Those are compiled, each as its own region (``Drafter.compile_regions``: (object, method name) pairs the drafter
names; ``distill.chunked``'s loss core), the way torchtitan and HF's regional compilation compile one decoder layer
and reuse it for every layer of the same shape. Everything between regions runs eagerly, as before.

Graph breaks inside a region are counted from dynamo's own counters and logged by reason after the first step
(goal 0; ``CompileReport``). The regions are restored when training ends, so decoding and saving see the drafter's
plain methods.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from inference.runner import compile_setting as decoder_compile_setting

log = logging.getLogger(__name__)

# Graphs dynamo may keep per code object during training: a region is compiled again for another call signature
# (grad mode in the held-out evaluation, a layer class shared by several regions), and the default (8) would silently
# leave the ninth eager.
RECOMPILE_LIMIT = 64
ZERO3_REFUSAL = ("trainer.compile=on cannot run under DeepSpeed ZeRO-3 (trainer=zero3): its partitioned parameters "
                 "are gathered by module hooks a compiled region would read around; use trainer.compile=off, or "
                 "trainer=fsdp / zero2 to train compiled")


def compile_setting(value: str | bool) -> str:
    """``trainer.compile`` as auto / on / off (``inference.runner.compile_setting``'s reading)."""
    return decoder_compile_setting(value, key="trainer.compile")


def check_compile(value: str | bool, engine: str, zero_stage: int) -> None:
    """The start-up check: a valid setting, and ``on`` never under DeepSpeed ZeRO-3."""
    if compile_setting(value) == "on" and engine == "deepspeed" and zero_stage == 3:
        raise ValueError(ZERO3_REFUSAL)


def resolve_compile(value: str | bool, device: torch.device, engine: str, zero_stage: int) -> bool:
    """Whether the training step is compiled: ``on``, or ``auto`` on a CUDA device (on a CPU, inductor's compile
    time is more than a short run saves). DeepSpeed ZeRO-3 partitions the parameters a region reads and gathers them
    in module hooks that a compiled method would bypass: refused under ``on``, off under ``auto``."""
    check_compile(value, engine, zero_stage)
    setting = compile_setting(value)
    if setting == "off":
        return False
    if engine == "deepspeed" and zero_stage == 3:
        log.info("trainer.compile=auto: off under DeepSpeed ZeRO-3 (partitioned parameters)")
        return False
    return setting == "on" or device.type == "cuda"


@dataclass
class CompileReport:
    """What compilation did so far: regions, graphs dynamo built, graph breaks by reason, seconds of the first step."""

    regions: int = 0
    graphs: int = 0
    graph_breaks: Counter = field(default_factory=Counter)
    first_step_s: float | None = None
    _breaks_at_start: Counter = field(default_factory=Counter)
    _graphs_at_start: int = 0

    def update(self) -> None:
        from torch._dynamo.utils import counters

        self.graph_breaks = Counter(counters["graph_break"]) - self._breaks_at_start
        self.graphs = counters["stats"]["unique_graphs"] - self._graphs_at_start

    def summary(self) -> dict:
        self.update()
        out = {"compile/regions": self.regions, "compile/graphs": self.graphs,
               "compile/graph_breaks": sum(self.graph_breaks.values())}
        if self.first_step_s is not None:
            out["compile/first_step_s"] = self.first_step_s
        return out

    def log_first_step(self, seconds: float) -> None:
        self.first_step_s = seconds
        self.update()
        breaks = sum(self.graph_breaks.values())
        log.info("trainer.compile: %d regions, %d graphs compiled in the first step (%.1f s), %d graph break(s)",
                 self.regions, self.graphs, seconds, breaks)
        for reason, count in self.graph_breaks.most_common():
            log.warning("trainer.compile: graph break x%d: %s", count, reason.splitlines()[0][:300])


@contextlib.contextmanager
def compiled_regions(regions: Sequence[tuple[object, str]], enabled: bool, backend: str | None = None,
                     strict: bool = True) -> Iterator[CompileReport | None]:
    """Inside this block each ``(owner, name)`` region's ``owner.name`` is its ``torch.compile``d version (set on
    the instance, so it shadows the class's method for this object only); restored on exit. ``backend``: inductor
    when None (tests pass ``aot_eager``: dynamo and AOT autograd without code generation). ``strict=False``
    (``trainer.compile=auto``): a region that fails to compile runs eagerly, with dynamo's warning, instead of
    stopping the run. Yields the report, or None when ``enabled`` is false."""
    if not enabled:
        yield None
        return
    from torch._dynamo.utils import counters

    from distill.chunked import compiled_loss

    report = CompileReport(regions=len(regions), _breaks_at_start=Counter(counters["graph_break"]),
                           _graphs_at_start=counters["stats"]["unique_graphs"])
    kw = {"backend": backend} if backend else {}
    patched = []
    config = torch._dynamo.config
    limit, suppress = config.recompile_limit, config.suppress_errors
    config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    config.suppress_errors = suppress or not strict
    try:
        for owner, name in regions:
            if name in vars(owner):  # compiled already (a region named twice): once is enough
                continue
            vars(owner)[name] = torch.compile(getattr(owner, name), **kw)
            patched.append((owner, name))
        with compiled_loss(kw):
            yield report
    finally:
        for owner, name in patched:
            vars(owner).pop(name, None)
        config.recompile_limit, config.suppress_errors = limit, suppress


class FirstStepTimer:
    """Times the first training step, compilation included, and hands it to the report (no-op when not compiled)."""

    def __init__(self, report: CompileReport | None):
        self.report, self.start = report, time.perf_counter()

    def done(self) -> None:
        if self.report is not None and self.report.first_step_s is None:
            self.report.log_first_step(time.perf_counter() - self.start)
