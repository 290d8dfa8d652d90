"""Kernels per decode step, eager against compiled: a CPU proxy for what a GPU launches per step.

    python scripts/bench_step_kernels.py               # the gpu preset's layer structure, narrow (about 3 minutes)
    python scripts/bench_step_kernels.py --hidden 64   # quicker; the counts depend on the layers, not the width

Under CUDA graphs a step costs what its kernels cost: a graph removes the launches' host time, not the kernels, and
the Hugging Face forward is hundreds of small kernels that ``decoder.compile`` (inductor) fuses. This counts them per
step, for a random-weight target of ``scripts/bench_decode.py``'s ``gpu`` preset architecture (Llama-shaped, 22
layers, 16 heads, MLP 2.75x the hidden size, the toy's 4,096-token vocabulary) made narrow (hidden 256 by default):
the number of kernels depends on the layer structure (layers, ops per layer), not on the width (hidden 64 and 256
count the same plain and verify steps), so a narrow target counts like the 2,048-wide one at a fraction of the
compile time. Steps, as the decoder runs them at batch 1
(``inference.batch_decoder``'s one-row bucket, eager, no CUDA graphs): the plain step, EAGLE-1's verify step over its default 16-node
dynamic tree, and EAGLE-1's static draft step (an untrained drafter of the target's width, conf/drafter/eagle1.yaml).

Per step:
- eager: the aten ops the step dispatches (a ``TorchDispatchMode``) that launch a kernel on a GPU: every op except
  ``VIEW_OPS`` (views and metadata: no kernel) and ``ALLOCATIONS`` (memory, no kernel);
- compiled: ``torch.compile(fullgraph=True, dynamic=False)`` with inductor, counted in the generated wrapper's
  ``call``: the calls of inductor's own kernels (one per launch; inductor defines a kernel once for identical code,
  so fewer are defined (``distinct_kernels``) than called; ``torch._inductor.metrics.generated_kernel_count`` is
  not used: it counted more kernels than the wrapper defines or calls), plus the extern calls it keeps
  (``extern_kernels.mm`` / ``addmm`` / ``bmm``, the attention op) and any other aten op the wrapper still calls (a
  fallback). On a CPU inductor emits C++ loops where a GPU gets Triton kernels, and picks CPU attention and matmul
  calls, so this is a proxy of the fusion, not the GPU's count;
- the seconds compiling the step took on this CPU (its first compiled call; caches off).

Each step runs once as it is (warm-up), once under the op counter, then once compiled; every run is a real step of
the decode. Writes ``scripts/results/bench_step_kernels_cpu.json``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill.atomic import write_text_atomically  # noqa: E402
from distill.teacher import Teacher  # noqa: E402
from eval.report import machine_info  # noqa: E402
from inference.sampling import GREEDY  # noqa: E402
from inference.batch_decoder import BucketDecoder  # noqa: E402
from inference.runner import StepRunner  # noqa: E402

OUT = ROOT / "scripts" / "results" / "bench_step_kernels_cpu.json"
# The gpu preset of scripts/bench_decode.py: 22 layers, 16 heads, MLP 5632 / 2048 = 2.75x hidden; vocabulary 4,096.
LAYERS, HEADS, MLP_RATIO, VOCAB = 22, 16, 5632 / 2048, 4096
# Ops that launch no kernel: views and metadata (a new tensor header over the same memory) ...
VIEW_OPS = frozenset({"view", "_unsafe_view", "_reshape_alias", "reshape", "expand", "expand_as", "as_strided", "t",
                      "transpose", "permute", "slice", "select", "narrow", "unsqueeze", "squeeze", "unbind", "split",
                      "split_with_sizes", "chunk", "view_as", "detach", "alias", "lift_fresh", "unfold", "movedim",
                      "diagonal", "_neg_view", "_conj", "real", "imag", "view_as_real", "view_as_complex",
                      "t_", "transpose_", "unsqueeze_", "squeeze_", "as_strided_"})
# ... and allocations (memory from the caching allocator, no kernel; a zeros / full is an allocation and a fill_)
ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_"})
# Lines of the compiled wrapper's ``call`` that run a kernel: inductor's own (cpp_fused_* on a CPU, triton_* on a
# GPU), the extern calls it keeps, and aten ops it calls as they are.
CALL_DEF = re.compile(r"^\s*def call\(")
KERNEL_CALL = re.compile(r"^\s*((?:cpp|triton)_\w+)(?:\.run)?\(")
EXTERN_CALL = re.compile(r"\bextern_kernels\.(\w+)\(")
FALLBACK_CALL = re.compile(r"\b(?:torch\.ops\.)?(aten|prims|mkldnn|quantized)\.(\w+)(?:\.\w+)?\(")


def target_model(hidden: int = 256, layers: int = LAYERS, heads: int = HEADS, vocab: int = VOCAB, seed: int = 0):
    """The gpu preset's architecture at ``hidden`` wide, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * MLP_RATIO),
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def tiny_target():
    """One layer, 32 wide: the fast test's target."""
    return target_model(hidden=32, layers=1, heads=2, vocab=128)


class OpCounter(TorchDispatchMode):
    """The aten ops dispatched, by name, split into kernel ops and the rest (``VIEW_OPS``, ``ALLOCATIONS``)."""

    def __init__(self):
        super().__init__()
        self.kernels: collections.Counter = collections.Counter()
        self.other: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        (self.other if name in VIEW_OPS or name in ALLOCATIONS else self.kernels)[name] += 1
        return func(*args, **(kwargs or {}))


def wrapper_calls(code: str) -> dict:
    """The kernel launches of a compiled graph's wrapper code: the lines of its ``call`` function (comments aside)
    that call one of inductor's kernels, an extern kernel or an aten op."""
    lines = code.splitlines()
    start = next((i for i, line in enumerate(lines) if CALL_DEF.match(line)), None)
    if start is None:
        raise ValueError("no `def call(` in inductor's wrapper code: its layout changed; update wrapper_calls")
    indent = len(lines[start]) - len(lines[start].lstrip())
    kernels, extern, fallback = collections.Counter(), collections.Counter(), collections.Counter()
    for line in lines[start + 1:]:
        stripped = line.lstrip()
        if stripped and len(line) - len(stripped) <= indent:
            break  # the end of ``call``
        if stripped.startswith("#"):
            continue
        if m := KERNEL_CALL.match(line):
            kernels[m.group(1)] += 1
        elif m := EXTERN_CALL.search(line):
            extern[m.group(1)] += 1
        elif m := FALLBACK_CALL.search(line):
            fallback[f"{m.group(1)}.{m.group(2)}"] += 1
    return {"kernels": sum(kernels.values()), "distinct_kernels": len(kernels), "extern": sum(extern.values()),
            "fallback": sum(fallback.values()), "extern_by_name": dict(extern), "fallback_by_name": dict(fallback)}


class Probe:
    """A step of the decode as this bench runs it: call 1 as it is, call 2 under ``OpCounter``, call 3 compiled with
    inductor (its wrapper code kept), later calls as they are."""

    def __init__(self, fn, name: str):
        self.fn, self.name, self.calls, self.result = fn, name, 0, {}

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == 2:
            with OpCounter() as ops:
                self.fn()
            self.result["eager"] = {"kernel_ops": sum(ops.kernels.values()), "views_and_allocations":
                                    sum(ops.other.values()), "by_op": dict(ops.kernels.most_common())}
        elif self.calls == 3:
            from torch._inductor.utils import run_and_get_code

            compiled = torch.compile(self.fn, fullgraph=True, dynamic=False)
            start = time.perf_counter()
            _, codes = run_and_get_code(compiled)
            seconds = time.perf_counter() - start
            if len(codes) != 1:
                raise RuntimeError(f"step {self.name}: expected one compiled graph, got {len(codes)}")
            calls = wrapper_calls(codes[0])
            calls["total"] = calls["kernels"] + calls["extern"] + calls["fallback"]
            self.result["compiled"] = calls
            self.result["compile_seconds"] = round(seconds, 2)
        else:
            self.fn()


class ProbingRunner(StepRunner):
    """The decoder's step runner (eager steps, no graphs) with every step function it is handed run through a
    ``Probe``."""

    def __init__(self, device):
        super().__init__(device, torch.Generator().manual_seed(0), cuda_graphs="off")
        self.probes: dict[str, Probe] = {}

    def wrap(self, fn, label: str = "step", kind: tuple | None = None):
        if isinstance(fn, functools.partial) and fn.func.__name__ == "verify":
            bucket = fn.args[0]
            name = f"verify_{'chain' if bucket.chain else 'tree'}_{bucket.nodes}"
        elif isinstance(fn, functools.partial):
            name = fn.func.__name__
        else:  # a draft step: the drafter's static draft at the bucket's rows
            owner = getattr(fn, "__self__", fn)
            name = f"{getattr(owner, 'proto', owner).__class__.__name__}.{fn.__name__}"
        probe = self.probes.setdefault(name, Probe(fn, name))
        return probe if probe.fn is fn else fn  # one probe per kind of step (the first bucket of it)


def eagle1(teacher, seed: int = 0):
    """An untrained EAGLE-1 drafter as conf/drafter/eagle1.yaml configures it, at the target's width."""
    from omegaconf import OmegaConf

    from heads.base import build_drafter

    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "drafter" / "eagle1.yaml"))
    torch.manual_seed(seed)
    drafter = build_drafter(node, teacher)
    drafter.bind_target(teacher, initialize=True)
    return drafter.eval()


def count_steps(model, drafter: bool = True, new_tokens: int = 8) -> dict:
    """{step name: counts} for the plain step and (``drafter``) EAGLE-1's verify and static draft steps."""
    teacher = Teacher(model, tokenizer=None, name="bench-step-kernels")
    runner = ProbingRunner(teacher.device)
    dec = BucketDecoder(teacher, sampling=GREEDY, runner=runner)
    prompt = torch.randint(0, teacher.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        dec.plain([prompt], new_tokens)
        if drafter:
            dec.speculative(eagle1(teacher), [prompt], new_tokens, num_draft=4)  # eval.num_draft's default depth
    unfinished = [name for name, p in runner.probes.items() if p.calls < 3]
    if unfinished:
        raise RuntimeError(f"steps {unfinished} ran fewer than 3 times; raise new_tokens ({new_tokens})")
    return {name: p.result for name, p in runner.probes.items()}


def count_step(model, name: str = "plain") -> dict:
    """The counts of one step of ``count_steps`` (the plain step needs no drafter)."""
    return count_steps(model, drafter=name != "plain")[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="target width (the gpu preset's is 2048)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = target_model(args.hidden)
    steps = count_steps(model)
    for name, r in steps.items():
        c = r["compiled"]
        print(f"{name}: eager {r['eager']['kernel_ops']} kernel ops; compiled {c['total']} ({c['kernels']} inductor "
              f"kernels, {c['extern']} extern, {c['fallback']} fallback); compile {r['compile_seconds']} s",
              flush=True)
    command = "python scripts/bench_step_kernels.py" + (f" --hidden {args.hidden}" if args.hidden != 256 else "")
    settings = {"layers": LAYERS, "heads": HEADS, "hidden_size": args.hidden,
                "intermediate_size": int(args.hidden * MLP_RATIO), "vocab_size": VOCAB, "weights": "random",
                "drafter": "EAGLE-1 (conf/drafter/eagle1.yaml), untrained, dynamic tree of 16 nodes, depth 4",
                "width_note": "the gpu preset's architecture (hidden 2048) made narrow: kernel counts depend on the "
                              "layer structure, not the width (at hidden 64 the plain and verify steps count the "
                              "same, the draft step 3 kernels more); inductor on a GPU may still split a wide "
                              "reduction into two kernels, which a CPU count does not see",
                "proxy_note": "inductor on a CPU emits C++ loops (cpp_fused_*) where a GPU gets Triton kernels, and "
                              "CPU matmul / attention calls: a proxy of the fusion, not the GPU's kernel count",
                "view_ops": sorted(VIEW_OPS), "allocations": sorted(ALLOCATIONS)}
    write_text_atomically(args.out, json.dumps({"machine": machine_info(), "command": command, "settings": settings,
                                                "steps": steps}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
