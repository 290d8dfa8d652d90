"""What a decode returns and the checks every decoder shares: ``Generation`` (one sequence's new tokens, times and
acceptance counts), ``finish`` (where every decoder and baseline cuts its output), the vocabulary and prompt checks,
and the prefill's ``logits_to_keep``. Below ``inference.decoder`` (batch 1) and ``inference.batch_decoder``
(batches)."""

from __future__ import annotations

import inspect
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference.proposer import Proposer
from inference.stats import AcceptStats

ACCEPTANCE_RULES = ("exact", "typical")  # exact: greedy match / rejection sampling (lossless); typical: Medusa's, lossy


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
    verified_positions: int = 0  # positions the verification forwards fed (their widths, padding included), summed
    shapes: dict = field(default_factory=dict)  # tree size -> parents of a tree of that size (to time it alone)
    # first calls of compiled steps during this decode (their compilation): left out of every time above, as an
    # engine's start-up compilation is left out of its decode times
    compile_seconds: float = 0.0

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
        self.verified_positions += other.verified_positions
        self.compile_seconds += other.compile_seconds
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


def check_prompt(prompt_ids: Tensor, max_new_tokens: int, lookahead: int, max_positions: int) -> None:
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # timings must cover the kernels, not just their launch
        torch.cuda.synchronize(device)


def cache_kwarg(model) -> str:
    """The name the model's forward takes its KV cache under: ``cache`` where the installed transformers has it
    (``past_key_values`` is deprecated there), else ``past_key_values`` (older releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def check_batch(prompts: Sequence, max_new_tokens: int, lookahead: int, max_positions: int) -> list[Tensor]:
    """Prompts as 1-D long tensors; errors name the prompt and the fix."""
    if len(prompts) == 0:
        raise ValueError("no prompts: a batch needs at least one")
    out = []
    for i, p in enumerate(prompts):
        ids = torch.as_tensor(p, dtype=torch.long).reshape(1, -1)
        try:
            check_prompt(ids, max_new_tokens, lookahead, max_positions)
        except ValueError as e:
            raise ValueError(f"prompt {i} of the batch of {len(prompts)}: {e}") from None
        out.append(ids[0])
    return out


def batch_bucket(rows: int) -> int:
    """The batch bucket of ``rows`` live rows: the smallest power of two holding them."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


@dataclass
class BatchGeneration:
    """One batched decode. ``generations[i]`` is prompt i's (input order); its ``seconds`` is the time from the start
    of the batch to that sequence leaving it (its latency)."""

    generations: list[Generation]
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    compile_seconds: float = 0.0  # first calls of compiled steps (left out of every time above)
    steps: int = 0
    stats: AcceptStats = field(default_factory=AcceptStats)
    gamma_steps: Counter = field(default_factory=Counter)  # γ chosen -> steps
    live_steps: Counter = field(default_factory=Counter)  # live batch size -> steps
    bucket_steps: Counter = field(default_factory=Counter)  # batch bucket -> steps
    step_log: list = field(default_factory=list)  # per step: (live rows, γ, draft seconds, verify seconds)

    @property
    def new_tokens(self) -> int:
        return sum(len(g.new_tokens) for g in self.generations)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def latency_ms_per_token(self) -> float:
        """Mean over sequences of (time to leave the batch) / (its new tokens), in ms."""
        per = [1000 * g.seconds / len(g.new_tokens) for g in self.generations if g.new_tokens]
        return sum(per) / len(per) if per else 0.0

    def extend(self, part: "BatchGeneration") -> None:
        """Append ``part``, decoded after this one (the next group of prompts): its latencies then count from the
        start of this decode."""
        for gen in part.generations:
            gen.seconds += self.seconds
        self.generations += part.generations
        for name in ("seconds", "prefill_seconds", "draft_seconds", "verify_seconds", "compile_seconds", "steps"):
            setattr(self, name, getattr(self, name) + getattr(part, name))
        self.stats.merge(part.stats)
        for name in ("gamma_steps", "live_steps", "bucket_steps"):
            getattr(self, name).update(getattr(part, name))
        self.step_log += part.step_log


def one_sampling(sampling, n: int, default):
    """The one ``SamplingConfig`` a batch of ``n`` prompts decodes with: ``sampling`` (None: ``default``), or a list
    of one per prompt, all equal."""
    from inference.sampling import SamplingConfig

    if sampling is None or isinstance(sampling, SamplingConfig):
        return sampling or default
    settings = list(sampling)
    if len(settings) != n or not all(isinstance(s, SamplingConfig) for s in settings):
        raise ValueError(f"sampling has {len(settings)} settings for {n} prompts; give one SamplingConfig for the "
                         f"whole batch")
    if len(set(settings)) > 1:
        raise ValueError(f"sampling differs between the rows of one batch ({sorted({s.describe() for s in settings})}"
                         f"); a batch decodes with one SamplingConfig: decode each setting as its own batch")
    return settings[0]
