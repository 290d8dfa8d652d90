"""Evaluation prompts: held-out stdlib excerpts or the records of a prompt file.

``heldout_prompts`` cuts fixed-length prompts from the held-out stdlib split
(``distill.corpus``); ``prompts_from_file`` reads MT-bench / Spec-Bench style
jsonl files, rendering chat turns as chat training data is (``distill.chat``),
and ``prompt_records_from_file`` adds each record's category.
``context_length_prompts`` cuts the same held-out passages to one prompt length per
context length (``eval.context_lengths``).
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Mapping
from pathlib import Path

from distill.chat import chat_renderer, render_plain
from distill.corpus import stdlib_sources
from distill.data import read_jsonl, default_prefix_ids, encode_text, regular_path

logger = logging.getLogger(__name__)

# Prompts start where a reader would: at a definition. Indented methods count,
# so small files with one class still offer many starting points.
_DEFINITION_LINE = re.compile(r"^[ \t]*(?:async[ \t]+def|def|class)[ \t]", re.MULTILINE)
_NONBLANK_LINE = re.compile(r"^(?=[ \t]*\S)", re.MULTILINE)


def heldout_prompts(tokenizer, num_prompts: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` distinct prompts of exactly ``prompt_tokens`` ids from the held-out stdlib split.

    Deterministic for a given seed, tokenizer and Python. Files are visited
    round-robin in a seeded order, taking one prompt per file per round, so the
    prompts spread over as many files as there are prompts; each starts at the
    beginning of a seeded-random ``def``/``class`` line of its file (any
    non-blank line in files without one).
    """
    prefix = default_prefix_ids(tokenizer)
    if num_prompts <= 0 or prompt_tokens <= len(prefix):
        raise ValueError(
            f"eval: num_prompts={num_prompts} must be > 0 and prompt_tokens={prompt_tokens} must be > "
            f"{len(prefix)} (the tokenizer's BOS); raise them"
        )
    rng = random.Random(seed)
    sources = stdlib_sources("heldout")
    order = list(range(len(sources)))
    rng.shuffle(order)
    starts = {i: _shuffled_line_starts(sources[i][1], rng) for i in order}
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < num_prompts and starts:
        for i in [i for i in order if i in starts]:
            prompt = _next_prompt(tokenizer, sources[i][1], starts[i], prompt_tokens, prefix, seen)
            if prompt is None:
                del starts[i]  # file exhausted
                continue
            prompts.append(prompt)
            seen.add(tuple(prompt))
            if len(prompts) == num_prompts:
                break
    if len(prompts) < num_prompts:
        raise ValueError(
            f"eval: the held-out corpus gives only {len(prompts)} distinct prompts of {prompt_tokens} tokens, "
            f"fewer than num_prompts={num_prompts}; lower eval.num_prompts or eval.prompt_tokens"
        )
    return prompts


def _shuffled_line_starts(text: str, rng: random.Random) -> list[int]:
    starts = [m.start() for m in _DEFINITION_LINE.finditer(text)]
    if not starts:
        starts = [m.start() for m in _NONBLANK_LINE.finditer(text)]
    rng.shuffle(starts)
    return starts


def _next_prompt(tokenizer, text: str, starts: list[int], prompt_tokens: int, prefix: list[int], seen: set):
    """Pop start offsets until one gives a full-length prompt not seen before; None when out of starts."""
    needed = prompt_tokens - len(prefix)
    while starts:
        ids = _tokens_from(tokenizer, text, starts.pop(), needed)
        if ids is not None and tuple(prefix + ids) not in seen:
            return prefix + ids
    return None


def _tokens_from(tokenizer, text: str, start: int, needed: int) -> list[int] | None:
    """The first ``needed`` token ids of ``text[start:]``, or None if it is shorter.

    Tokenises a growing window instead of the whole remaining file; asking for
    one token more than needed keeps the last kept token clear of the window's
    cut, where it could be a fragment of a longer token.
    """
    window = 4 * (needed + 1)
    while True:
        chunk = text[start : start + window]
        ids = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        if len(ids) > needed:
            return list(ids[:needed])
        if start + window >= len(text):
            return list(ids) if len(ids) == needed else None
        window *= 2


def cut_prompt(ids: list[int], prompt_tokens: int, tokenizer) -> list[int]:
    """A prompt cut to ``prompt_tokens``: its leading special tokens (BOS) and its last tokens, so the text's end (a
    question's end and the assistant header it continues from) stays."""
    if len(ids) <= prompt_tokens:
        return ids
    prefix = default_prefix_ids(tokenizer) if tokenizer is not None else []
    prefix = prefix if ids[: len(prefix)] == prefix and len(prefix) < prompt_tokens else []
    return prefix + ids[len(ids) - (prompt_tokens - len(prefix)):]


def context_prompt_tokens(lengths, max_new_tokens: int, lookahead: int, max_positions: int = 0,
                          min_tokens: int = 1) -> dict[int, int]:
    """Prompt length per context length (``eval.context_lengths``): a bucket of length L decodes prompts of
    L - max_new_tokens - lookahead tokens, so its last verification reaches position L. Refuses lengths that are not
    distinct positive integers, longer than ``max_positions`` (0: unknown), or too short to leave ``min_tokens``
    prompt tokens (the tokenizer's BOS and one token of text)."""
    lengths = list(lengths)
    if len(set(lengths)) != len(lengths) or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"eval.context_lengths={lengths} must be distinct positive integers (context lengths in "
                         f"tokens, e.g. [64,128,256]), or null to measure one bucket only")
    if max_positions and max(lengths) > max_positions:
        raise ValueError(f"eval.context_lengths has {max(lengths)}, longer than the target's {max_positions} "
                         f"positions (max_position_embeddings); drop it or use lengths up to {max_positions}")
    sizes = {}
    for n in sorted(lengths):
        prompt = n - max_new_tokens - lookahead
        if prompt < min_tokens:
            raise ValueError(f"eval.context_lengths has {n}: its prompts would hold {n} - eval.max_new_tokens="
                             f"{max_new_tokens} - {lookahead} draft tokens = {prompt} tokens, fewer than the "
                             f"{min_tokens} a prompt needs; use lengths of at least "
                             f"{max_new_tokens + lookahead + min_tokens} or lower eval.max_new_tokens")
        sizes[n] = prompt
    return sizes


def context_length_prompts(tokenizer, num_prompts: int, sizes: Mapping[int, int]) -> dict[int, list[list[int]]]:
    """Per context length, ``num_prompts`` held-out prompts of ``sizes[length]`` tokens, all cut from the same
    passages: the longest bucket's prompts (``heldout_prompts``), each kept whole there and cut to its last tokens
    (BOS kept) for a shorter bucket. Every bucket continues the same text from the same point; only how much of the
    passage precedes it changes."""
    longest = heldout_prompts(tokenizer, num_prompts, max(sizes.values()))
    return {n: [cut_prompt(p, size, tokenizer) for p in longest] for n, size in sizes.items()}


def prompts_from_file(path: str, tokenizer, num_prompts: int | None, chat_template: str = "auto") -> list[list[int]]:
    """The first ``num_prompts`` prompts of a jsonl file (all of them for None).

    Records are ``{"turns": [...]}`` (MT-bench / Spec-Bench question.jsonl: the
    first turn becomes a user message, rendered with the chat template and its
    generation prompt, or the plain template, as chat training data is), or
    ``{"prompt": ...}`` / ``{"text": ...}``, tokenised as raw text.
    """
    return [ids for ids, _ in prompt_records_from_file(path, tokenizer, num_prompts, chat_template)]


def prompt_records_from_file(
    path: str, tokenizer, num_prompts: int | None, chat_template: str = "auto"
) -> list[tuple[list[int], str | None]]:
    """``(prompt ids, category)`` for the first ``num_prompts`` records of a jsonl file (all for None).

    The ids are exactly ``prompts_from_file``'s; the category is the record's
    ``category`` field (Spec-Bench / MT-bench: "writing", "coding", ...) or None,
    so the eval can report acceptance per kind of prompt, where drafters differ most.
    """
    p = regular_path("eval.prompts", path)
    if not p.is_file():
        raise ValueError(f"eval.prompts: file {p} does not exist; set eval.prompts=<question.jsonl> or null")
    records = read_jsonl(p, key="eval.prompts")
    if num_prompts is not None:
        records = records[:num_prompts]
    if not records:
        raise ValueError(f"eval.prompts: {p} holds no prompts; point it at a non-empty jsonl file")
    if num_prompts is not None and len(records) < num_prompts:
        logger.warning("eval.prompts: %s holds %d prompts, fewer than num_prompts=%d", p, len(records), num_prompts)
    render = chat_renderer(tokenizer, chat_template)
    prefix = default_prefix_ids(tokenizer)
    found = []
    for index, record in enumerate(records):
        ids = _prompt_record_ids(record, index, p, tokenizer, render, prefix)
        if not ids:
            raise ValueError(f"eval.prompts: {p} record {index} tokenises to nothing; remove it")
        found.append((ids, _record_category(record, index, p)))
    return found


def _record_category(record: Mapping, index: int, path: Path) -> str | None:
    category = record.get("category")
    if category is not None and not isinstance(category, str):
        raise ValueError(
            f"eval.prompts: {path} record {index} 'category' must be a string, got {category!r}; fix or drop it"
        )
    return category


def _prompt_record_ids(record: Mapping, index: int, path: Path, tokenizer, render, prefix: list[int]) -> list[int]:
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"eval.prompts: {path} record {index} 'turns' must be a non-empty list of strings")
        text = render([{"role": "user", "content": turns[0]}], True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        # A chat template writes its own BOS; the plain rendering needs the tokenizer's.
        return prefix + ids if render is render_plain else ids
    for key in ("prompt", "text"):
        if key in record:
            if not isinstance(record[key], str):
                raise ValueError(f"eval.prompts: {path} record {index} {key!r} must be a string")
            return encode_text(tokenizer, record[key])
    raise ValueError(
        f"eval.prompts: {path} record {index} has none of 'turns', 'prompt', 'text' (keys: {sorted(record)}); "
        "use question.jsonl-style records"
    )
