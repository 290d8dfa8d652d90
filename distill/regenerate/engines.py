"""How each rank generates a batch of answers (``regenerate.engine``).

Every engine answers ``generate(prompts, max_new_tokens, seed) -> [new tokens per prompt]``: the new tokens of each
prompt, ending with EOS where the target chose to stop. ``seed`` is the batch's (``regenerate.seed + batch index``):
a batch gets the same answers whichever rank decodes it, which is what lets shards merge into a single process's
bytes.

- ``auto`` (the default): ``vllm`` where vLLM is installed, the target is on CUDA, was loaded from ``target.name``
  (a hub id or a directory vLLM can load too) and one process holds it whole (``regenerate.shard=none``); else the
  engine measured faster on the target's device type (``FASTEST``), so every rank of a launch picks the same one. The file's sidecar records the engine it resolved to.
- ``batched``: ``inference.batch_decoder.BucketDecoder``, this project's batched decoder (one recorded target
  step per token for every row of a batch bucket; finished rows masked, the batch moved to smaller buckets as they
  finish; compiled and recorded as CUDA graphs on CUDA, as ``decoder.compile`` / ``decoder.cuda_graphs=auto`` do).
- ``hf``: transformers' ``generate()``, left-padded, on CUDA with a static KV cache (which transformers compiles).
  A maintained library path, and the one to compare against (scripts/bench_regenerate.py). Greedy answers can differ
  from ``batched``'s where two logits tie within rounding, since padding changes the kernels' shapes.
- ``vllm``: ``vllm.LLM.generate`` on the target's directory (a local checkpoint, the toy target's cache) or hub id,
  with the batch's seed. vLLM's sampler is its own, so a ``vllm`` file is reproducible by vLLM (the same seed gives
  the same file), not byte-identical to the other engines'. vLLM is not a dependency: `make vllm-check` installs it
  into its own virtual environment, where tests/test_served_vllm.py regenerates with it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch

from inference.batch_decoder import BucketDecoder
from inference.batch_memory import check_rows_fit, row_bytes
from inference.sampling import SamplingConfig

ENGINES = ("auto", "batched", "hf", "vllm")
# ``auto`` without vLLM: the engine with the most new tokens/s per device type (scripts/bench_regenerate.py). CPU, toy
# target, one thread: batched 1.14x hf at batch 8 and 1.01x at batch 32, the same answers
# (scripts/results/bench_regenerate_toy_cpu.json); vLLM's CPU build, timed beside them, is the slowest of the three
# at batch 8 and 32 (bench_regenerate_vllm_tiny_cpu.json), so a CPU keeps batched even where vLLM is installed. CUDA: hf (a static cache transformers compiles) until the batched
# decoder's compiled, graphed steps are measured against it there. Any other device: hf, the maintained path.
FASTEST = {"cpu": "batched", "cuda": "hf"}


def check_batch_fits(teacher, batch_size, rows: int, positions: int) -> None:
    """``regenerate.batch_size`` against the device (``inference.batch_memory``): ``rows`` prompts decoded at once up
    to ``positions`` positions (the longest prompt and its answer budget)."""
    per_row = row_bytes(teacher.model, positions, 1, teacher.vocab_size)
    check_rows_fit("regenerate.batch_size", batch_size, rows, per_row, teacher.device)


def check_engine(name: str) -> None:
    if name not in ENGINES:
        raise ValueError(f"regenerate.engine={name!r}; valid: {list(ENGINES)}")


def resolve_engine(name: str, device: torch.device | str, shard: str = "none", named: bool = True) -> str:
    """``regenerate.engine`` as the engine that runs: ``auto`` resolved for the target's device (module docstring);
    ``named``: the target was loaded from its ``target.name``, which vLLM loads."""
    check_engine(name)
    if name != "auto":
        return name
    device_type = torch.device(device).type
    if device_type == "cuda" and shard == "none" and named and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return FASTEST.get(device_type, "hf")


def loaded_by_name(teacher) -> bool:
    """Whether vLLM can load the target itself: from ``target.name`` (a hub id or a directory) or from the directory
    it was loaded from (the toy target's cache)."""
    return vllm_model(teacher) is not None


def vllm_model(teacher) -> str | None:
    """What vLLM loads the target from: the directory its weights were read from (a local checkpoint, the toy
    target's cache), else its hub id when it was loaded by that name; None for a target built in this process."""
    source = getattr(teacher.model.config, "_name_or_path", None)
    if source and Path(source).is_dir():
        return str(Path(source).resolve())
    return teacher.name if source == teacher.name else None


def build_engine(name: str, teacher, eos: int | None, sampling: SamplingConfig):
    name = resolve_engine(name, teacher.device, named=loaded_by_name(teacher))
    if name == "batched":
        return BatchedEngine(teacher, eos, sampling)
    if name == "hf":
        return HFGenerateEngine(teacher, eos, sampling)
    return VLLMEngine(teacher, eos, sampling)


def _cut_at_eos(tokens: Sequence[int], eos: int | None) -> list[int]:
    tokens = list(tokens)
    if eos is not None and eos in tokens:
        return tokens[: tokens.index(eos) + 1]
    return tokens


class BatchedEngine:
    def __init__(self, teacher, eos: int | None, sampling: SamplingConfig):
        self.decoder = BucketDecoder(teacher, eos_token_id=eos, sampling=sampling)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int) -> list[list[int]]:
        self.decoder.reseed(seed)
        ids = [torch.tensor(p, dtype=torch.long) for p in prompts]
        return [list(g.new_tokens) for g in self.decoder.plain(ids, max_new_tokens).generations]


class HFGenerateEngine:
    def __init__(self, teacher, eos: int | None, sampling: SamplingConfig):
        self.model, self.eos, self.sampling = teacher.model, eos, sampling
        self.device = next(self.model.parameters()).device
        tokenizer = teacher.tokenizer
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad = pad if pad is not None else (eos if eos is not None else 0)

    def _config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        s = self.sampling
        # Every setting stated: a hub model's generation_config.json (top_k=50, repetition penalties) must not leak in.
        kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=not s.greedy, num_beams=1,
                      pad_token_id=self.pad, eos_token_id=self.eos, top_k=s.top_k or None,
                      top_p=s.top_p if not s.greedy else None, temperature=s.temperature if not s.greedy else None,
                      repetition_penalty=1.0)
        if self.device.type == "cuda":  # a fixed-shape cache transformers compiles the decode step for
            kwargs["cache_implementation"] = "static"
        return GenerationConfig(**kwargs)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's next token lands in the same column
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        torch.manual_seed(seed)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=self._config(max_new_tokens))
        return [_cut_at_eos(row, self.eos) for row in out[:, width:].tolist()]


class VLLMEngine:
    """``vllm.LLM.generate`` on the target's directory or hub id (``vllm_model``), one batch per call, in this
    process (``inference.vllm_engine``); the batch's seed for every request of it."""

    def __init__(self, teacher, eos: int | None, sampling: SamplingConfig):
        from inference.vllm_engine import Engine, import_vllm

        try:
            import_vllm()
        except ImportError as e:
            raise ValueError(f"regenerate.engine=vllm: {e}; or use regenerate.engine=batched or hf") from None
        model = vllm_model(teacher)
        if model is None:
            raise ValueError(f"regenerate.engine=vllm loads the target from a directory or hub id, but the target "
                             f"{teacher.name!r} was built in this process; use regenerate.engine=batched or hf")
        self.sampling = sampling
        # One engine per rank (data parallel over torchrun's ranks); vLLM's own tensor parallelism is not wired here.
        self.engine = Engine(model, teacher.max_positions, dtype=str(next(teacher.model.parameters()).dtype).removeprefix("torch."),
                             eos_token_id=eos)
        self.eos = eos

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int) -> list[list[int]]:
        s = self.sampling
        params = self.engine.params(max_new_tokens, s.temperature, s.top_p, s.top_k,
                                    seed=None if s.greedy else seed)
        return [_cut_at_eos(tokens, self.eos) for tokens in self.engine.generate(prompts, params)]

    def close(self) -> None:
        self.engine.close()
