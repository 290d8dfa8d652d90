"""Long records tokenised a bounded slice at a time.

A fast tokenizer holds far more than the ids for every token it returns (offsets, token strings, masks: hundreds
of bytes each), so one 100 MB record handed to it whole takes gigabytes before anything is cut. Here a record longer
than ``SLICE_CHARS`` is tokenised in slices of at most that many characters, each ending before a line break (else a
space) so that a slice boundary falls where the tokenizer would split anyway; and when only the first ``max_tokens``
tokens are kept (rows of ``data.max_length``, ``data.packing=false``) it stops once it has them, having read a few
times that many characters, never the rest.
"""

from __future__ import annotations

SLICE_CHARS = 1 << 20  # characters per tokenizer call: about a quarter of a million tokens of English or code
_CHARS_PER_TOKEN = 16  # a first slice this many characters per token wanted holds them all, but in odd text
_MIN_SLICE = 4096


def slice_size(max_tokens: int | None) -> int:
    """Characters per slice: enough for ``max_tokens`` (and a margin) in one slice, at most ``SLICE_CHARS``."""
    if max_tokens is None:
        return SLICE_CHARS
    return min(SLICE_CHARS, max(_MIN_SLICE, _CHARS_PER_TOKEN * max_tokens))


def slices(text: str, size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of consecutive slices covering ``text``, each at most ``size`` characters, each but the last
    ending before a line break (else a space) in its second half where there is one: the next slice then starts
    with the whitespace a word's token carries in front of it."""
    bounds, start = [], 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            half = start + size // 2
            cut = text.rfind("\n", half, end)
            cut = text.rfind(" ", half, end) if cut < 0 else cut
            end = cut if cut > start else end
        bounds.append((start, end))
        start = end
    return bounds


def tokenise(tokenizer, text: str, max_tokens: int | None = None,
             offsets: bool = False) -> tuple[list[int], list[tuple[int, int]] | None]:
    """``text``'s token ids (no special tokens) and, with ``offsets``, each token's character span in ``text``;
    with ``max_tokens``, only the first ``max_tokens``. Text within one slice is tokenised whole, exactly as the
    tokenizer would; longer text slice by slice (module docstring)."""
    ids: list[int] = []
    spans: list[tuple[int, int]] | None = [] if offsets else None
    for start, end in slices(text, slice_size(max_tokens)):
        enc = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=offsets, verbose=False)
        ids += enc["input_ids"]
        if spans is not None:
            spans += [(s + start, e + start) for s, e in enc["offset_mapping"]]
        if max_tokens is not None and len(ids) > max_tokens:
            break  # the tokens past a slice's end never reach the kept ones: the first slice held a margin
    if max_tokens is not None:
        ids = ids[:max_tokens]
        spans = spans[:max_tokens] if spans is not None else None
    return ids, spans
