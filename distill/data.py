"""Training batches for distilling a frozen target into a drafter.

Every training row is ``max_length`` tokens with three aligned tensors:

* ``input_ids``      the tokens the target and drafter see,
* ``attention_mask`` 1 on real tokens, 0 on right-padding (packing=false only),
* ``loss_mask``      True where the drafter should learn to predict token t: every
                     real token of text data, and only assistant tokens of chat data
                     when ``assistant_only_loss`` is on (prompts are given, not generated).

Data comes from the stdlib corpus (``distill.corpus``, always available offline),
a local file, or a ``datasets`` hub dataset; records are either plain text or
ShareGPT / OpenAI-messages conversations (rendered and masked by ``distill.chat``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import Dataset

from distill.chat import Example, chat_renderer, encode_chat, normalize_messages
from distill.corpus import corpus_fingerprint, stdlib_sources
from distill.fingerprint import update_with_file

logger = logging.getLogger(__name__)

VALID_SOURCES = ("stdlib", "file", "hub")
VALID_FORMATS = ("auto", "sharegpt", "text")
TEXT_SUFFIXES = (".txt", ".py")
DATA_MODES = ("fixed", "regenerated", "on_policy", "mixed")
ON_POLICY_MODES = ("on_policy", "mixed")  # the modes whose rows the draft writes (distill.onpolicy)

@dataclass
class DataConfig:
    """``data``: where training text comes from and how it becomes fixed-length rows (see module docstring)."""

    source: str = "stdlib"  # stdlib | file | hub
    path: Optional[str] = None  # source=file: .jsonl / .json / .txt / .py file, or a directory of .txt/.py
    hub_name: Optional[str] = None  # source=hub: a datasets hub name
    hub_split: str = "train"
    text_field: str = "text"
    format: str = "auto"  # auto | sharegpt | text
    max_length: int = 256
    packing: bool = True  # concatenate into full blocks; false: one example per row, right-padded
    max_examples: Optional[int] = None
    chat_template: str = "auto"  # auto: the tokenizer's template when it has one | none: plain "role: content"
    assistant_only_loss: bool = True
    corpus_max_bytes: Optional[int] = None  # source=stdlib: cap the corpus (smoke runs)
    teacher_cache: Optional[str] = None  # a `python -m distill.cache` directory: train from it, not online
    # Where the training tokens come from (distill.onpolicy, distill.regenerate):
    # fixed: the data as it is | regenerated: the target's own answers to the data's prompts (data.regenerated) |
    # on_policy: the draft samples each row's continuation, the teacher scores it | mixed: a fraction on-policy.
    mode: str = "fixed"
    regenerated: Optional[str] = None  # a `python -m distill.regenerate` jsonl (mode=regenerated; mixed: the base)
    on_policy_fraction: float = 0.5  # mode=mixed: share of micro-batches whose continuations the draft samples
    on_policy_prompt_tokens: int = 64  # on-policy rows keep their first P tokens; the draft writes the rest
    on_policy_temperature: float = 1.0  # the draft's sampling temperature for on-policy continuations


def _describe_source(data_cfg: DataConfig) -> str:
    source = data_cfg.source
    if source == "file":
        return f"source=file path={data_cfg.path}"
    if source == "hub":
        return f"source=hub hub_name={data_cfg.hub_name} split={data_cfg.hub_split}"
    return f"source={source}"


# --------------------------------------------------------------------------- loading


def load_records(data_cfg: DataConfig) -> list[dict]:
    """Raw records from ``data.source``, capped at ``data.max_examples``."""
    source = data_cfg.source
    text_field = data_cfg.text_field
    if source == "stdlib":
        sources = stdlib_sources("train", max_bytes=data_cfg.corpus_max_bytes)
        records = [{text_field: text} for _, text in sources]
    elif source == "file":
        records = _load_file(data_cfg.path, text_field)
    elif source == "hub":
        records = _load_hub(data_cfg.hub_name, data_cfg.hub_split)
    else:
        raise ValueError(f"data.source: unknown source {source!r}; use one of {VALID_SOURCES}")
    max_examples = data_cfg.max_examples
    if max_examples is not None:
        if int(max_examples) <= 0:
            raise ValueError(f"data.max_examples: {max_examples!r} must be a positive int or null")
        records = records[: int(max_examples)]
    if not records:
        raise ValueError(f"data: {_describe_source(data_cfg)} yielded zero records; point it at non-empty data")
    logger.info("loaded %d records from %s", len(records), _describe_source(data_cfg))
    return records


def _load_file(path: str | None, text_field: str) -> list[dict]:
    if not path:
        raise ValueError("data.path: is null but data.source=file; set data.path=<jsonl|json|txt file or dir>")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(
            f"data.path: file {p} does not exist; set data.path=<jsonl|json|txt file> or data.source=stdlib"
        )
    try:
        if p.is_dir():
            return _read_text_dir(p, text_field)
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            return read_jsonl(p)
        if suffix == ".json":
            return _read_json(p)
        if suffix in TEXT_SUFFIXES:
            return [{text_field: p.read_text(encoding="utf-8")}]
    except UnicodeDecodeError as exc:
        raise not_utf8("data.path", p, exc) from None
    raise ValueError(
        f"data.path: unsupported file type {suffix!r} for {p}; use .jsonl, .json, .txt/.py or a directory"
    )


def not_utf8(key: str, path: Path, exc: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{key}: {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x}: {exc.reason}); re-encode "
                      f"it as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}`")


def read_jsonl(path: Path, key: str = "data.path") -> list[dict]:
    try:
        return _read_jsonl(path)
    except UnicodeDecodeError as exc:
        raise not_utf8(key, path, exc) from None


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # trailing blank lines are common and harmless
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"data.path: {path} line {line_no} is not valid JSON ({exc.msg}); fix or remove it"
                ) from exc
            if not isinstance(record, dict):
                raise ValueError(
                    f"data.path: {path} line {line_no} is a {type(record).__name__}, expected a JSON object"
                )
            records.append(record)
    return records


def _read_json(path: Path) -> list[dict]:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"data.path: {path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix the file") from exc
    # Both a bare list and the {"data": [...]} wrapper used by many dataset dumps.
    records = payload.get("data") if isinstance(payload, dict) else payload
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"data.path: {path} must hold a list of objects or {{\"data\": [objects]}}")
    return records


def _read_text_dir(root: Path, text_field: str) -> list[dict]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    records = []
    for p in files:
        try:
            records.append({text_field: p.read_text(encoding="utf-8")})
        except UnicodeDecodeError as exc:  # name the file inside the directory, not just the directory
            raise not_utf8("data.path", p, exc) from None
    return records


def _load_hub(hub_name: str | None, split: str) -> list[dict]:
    if not hub_name:
        raise ValueError("data.hub_name: is null but data.source=hub; set data.hub_name=<datasets hub name>")
    import datasets  # heavy import, only needed for hub data

    return [dict(row) for row in datasets.load_dataset(hub_name, split=split)]


# --------------------------------------------------------------------------- records and encoding


def record_kind(record: Mapping, index: int, fmt: str, text_field: str) -> str:
    """"chat" or "text": which of the two shapes ``record`` has under ``data.format``."""
    is_chat = "conversations" in record or "messages" in record
    if fmt == "sharegpt" or (fmt == "auto" and is_chat):
        if not is_chat:
            raise ValueError(
                f"data.format=sharegpt: record {index} has no 'conversations' or 'messages' "
                f"(keys: {sorted(record)}); use data.format=auto or text"
            )
        return "chat"
    if text_field in record:
        return "text"
    raise ValueError(
        f"data: record {index} has neither {text_field!r} nor 'conversations'/'messages' "
        f"(keys: {sorted(record)}); set data.text_field=<key holding the text>"
    )


def default_prefix_ids(tokenizer) -> list[int]:
    """The special ids the tokenizer puts before text by default (BOS for Llama-style, none for GPT-2)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if ids and ids[0] == bos else []


def encode_text(tokenizer, text: str) -> list[int]:
    """``text`` as the target sees a document: default BOS (if any), then the tokens, no EOS."""
    return default_prefix_ids(tokenizer) + list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- datasets


class TokenBlockDataset(Dataset):
    """Fixed-length rows held as three ``[N, T]`` tensors."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor):
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.loss_mask = loss_mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "loss_mask": self.loss_mask[index],
        }


def collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack equal-length items into ``[B, T]`` tensors."""
    if not items:
        raise ValueError("collate: got an empty batch; check the DataLoader's batch_size and dataset length")
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def encode_records(records: Sequence[Mapping], tokenizer, data_cfg: DataConfig, eos: int | None) -> list[Example]:
    """Every record as (ids, loss_mask) followed by ``eos`` (when given); empty records are skipped.

    Text trains on every token, its EOS included. In chat data with assistant-only
    loss the template's end-of-turn token already ends each reply, so the EOS is
    only a separator between conversations and carries no loss.
    """
    fmt, text_field = data_cfg.format, data_cfg.text_field
    if fmt not in VALID_FORMATS:
        raise ValueError(f"data.format: {fmt!r} is not one of {VALID_FORMATS}")
    kinds = [record_kind(r, i, fmt, text_field) for i, r in enumerate(records)]
    prefix = default_prefix_ids(tokenizer)
    text_ids = _encode_texts(records, kinds, tokenizer, text_field)
    render = chat_renderer(tokenizer, data_cfg.chat_template)
    assistant_only = bool(data_cfg.assistant_only_loss)
    eos_ids = [] if eos is None else [eos]
    examples = []
    for i, record in enumerate(records):
        if kinds[i] == "text":
            ids = prefix + text_ids[i] if text_ids[i] else []
            mask = [True] * len(ids)
        else:
            ids, mask = encode_chat(tokenizer, normalize_messages(record, i), render, assistant_only, prefix)
        if ids:
            eos_loss = kinds[i] == "text" or not assistant_only
            examples.append((ids + eos_ids, mask + [eos_loss] * len(eos_ids)))
    if len(examples) < len(records):
        logger.info("skipped %d records that tokenised to nothing", len(records) - len(examples))
    return examples


def _encode_texts(records: Sequence[Mapping], kinds: Sequence[str], tokenizer, text_field: str) -> dict:
    """Token ids of every text record by index, in one batched call the fast tokenizer parallelises."""
    indices = [i for i, kind in enumerate(kinds) if kind == "text"]
    if not indices:
        return {}
    texts = [_text_of(records[i], i, text_field) for i in indices]
    # verbose=False: documents longer than the model context are expected here; packing cuts them into blocks.
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return {i: list(ids) for i, ids in zip(indices, encoded)}


def _text_of(record: Mapping, index: int, text_field: str) -> str:
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"data.text_field: record {index} {text_field!r} is {type(text).__name__}, expected a string")
    return text


def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer: has no eos_token, needed to separate examples; set tokenizer.eos_token")
    return tokenizer.eos_token_id


def pack_examples(examples: Sequence[Example], max_length: int) -> TokenBlockDataset:
    """Concatenate examples into full ``max_length`` blocks; the tail remainder is dropped."""
    ids = torch.tensor([t for e in examples for t in e[0]], dtype=torch.long)
    mask = torch.tensor([m for e in examples for m in e[1]], dtype=torch.bool)
    num_blocks = ids.numel() // max_length
    used = num_blocks * max_length
    ids, mask = ids[:used].view(num_blocks, max_length), mask[:used].view(num_blocks, max_length)
    return TokenBlockDataset(ids, torch.ones_like(ids), mask)


def pad_examples(examples: Sequence[Example], max_length: int, pad_id: int) -> TokenBlockDataset:
    """One example per row, truncated to ``max_length`` and right-padded."""
    n = len(examples)
    ids = torch.full((n, max_length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, max_length), dtype=torch.long)
    mask = torch.zeros((n, max_length), dtype=torch.bool)
    for row, (example_ids, example_mask) in enumerate(examples):
        length = min(len(example_ids), max_length)
        ids[row, :length] = torch.tensor(example_ids[:length], dtype=torch.long)
        attention[row, :length] = 1
        mask[row, :length] = torch.tensor(example_mask[:length], dtype=torch.bool)
    return TokenBlockDataset(ids, attention, mask)


def _pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id  # attention_mask 0 keeps padding out of the way
    raise ValueError("tokenizer: has neither pad_token nor eos_token, needed for data.packing=false; set one")


def _drop_rows_without_loss(dataset: TokenBlockDataset) -> TokenBlockDataset:
    """Rows with no loss token cost compute and would give a 0/0 mean loss."""
    keep = dataset.loss_mask.any(dim=1)
    if bool(keep.all()):
        return dataset
    logger.info("dropped %d of %d rows with no loss tokens", int((~keep).sum()), len(dataset))
    return TokenBlockDataset(dataset.input_ids[keep], dataset.attention_mask[keep], dataset.loss_mask[keep])


def _no_rows_message(data_cfg: DataConfig, examples: Sequence[Example], num_tokens: int, max_length: int,
                     packing: bool) -> str:
    """Why no training row is left, with the fix that applies: too little data for one packed block, or rows cut at
    ``max_length`` before their first loss token (then the limit must go *up*, not down)."""
    where = f"data: {_describe_source(data_cfg)} gave {num_tokens} tokens but no row with loss tokens"
    if packing and num_tokens < max_length:
        return f"{where}: fewer than one block of data.max_length={max_length}; add data or lower data.max_length"
    first_loss = [next((i for i, m in enumerate(mask) if m), len(mask)) for _, mask in examples]
    return (f"{where}: every row is cut at data.max_length={max_length} before its first loss token (the earliest "
            f"comes at token {min(first_loss)}); raise data.max_length above it (within the target's context), or "
            f"shorten the prompts")


def rows_fingerprint(dataset) -> str:
    """A content hash of the training rows (input ids, attention and loss masks): what a resume must find again.
    Paths and row counts say nothing about an edited file; this does. A dataset may provide its own
    ``content_fingerprint`` (the offline teacher cache: its manifest and shard digests)."""
    own = getattr(dataset, "content_fingerprint", None)
    if own is not None:
        return str(own)
    h = hashlib.sha256()
    names = ("input_ids", "attention_mask", "loss_mask")
    if isinstance(dataset, TokenBlockDataset):
        columns = [getattr(dataset, k) for k in names]
    else:  # any map-style dataset of TokenBlockDataset-like rows (tests, wrappers): the same columns, stacked
        columns = [torch.stack([dataset[i][k] for i in range(len(dataset))]) for k in names]
    for column in columns:
        h.update(str(tuple(column.shape)).encode())
        h.update(column.detach().to(torch.int64).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def source_fingerprint(data_cfg: DataConfig) -> str | None:
    """A content hash of the raw training data ``data_cfg`` reads (the file, a directory's text files, the stdlib
    corpus, the regenerated jsonl): an edited file at the same path hashes differently. None for hub datasets, which
    are named by hub name and split only."""
    h = hashlib.sha256()
    source = data_cfg.source
    if source == "stdlib":
        h.update(corpus_fingerprint(stdlib_sources("train", max_bytes=data_cfg.corpus_max_bytes)).encode())
    elif source == "file" and data_cfg.path:
        _hash_path(h, Path(data_cfg.path).expanduser())
    else:
        return None
    if data_cfg.regenerated:
        _hash_path(h, Path(data_cfg.regenerated).expanduser())
    return h.hexdigest()[:16]


def _hash_path(h, path: Path) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
    for p in files:
        h.update(p.relative_to(path).as_posix().encode() if path.is_dir() else b"")
        update_with_file(h, p)


def build_train_dataset(data_cfg: DataConfig, tokenizer) -> Dataset:
    """Tokenised, masked, fixed-length training rows from ``data_cfg`` (see module docstring)."""
    max_length = int(data_cfg.max_length)
    if max_length < 2:
        raise ValueError(f"data.max_length: {max_length} is too short; use at least 2 (typically 256-4096)")
    packing = bool(data_cfg.packing)
    # Packing needs EOS to mark where one document ends; padded rows use it when there is one.
    eos = _eos_id(tokenizer) if packing else tokenizer.eos_token_id
    examples = encode_records(load_records(data_cfg), tokenizer, data_cfg, eos)
    num_tokens = sum(len(ids) for ids, _ in examples)
    if num_tokens == 0:
        raise ValueError(f"data: {_describe_source(data_cfg)} tokenised to zero tokens; point it at non-empty data")
    if packing:
        dataset = pack_examples(examples, max_length)
    else:
        dataset = pad_examples(examples, max_length, _pad_id(tokenizer))
    dataset = _drop_rows_without_loss(dataset)
    if len(dataset) == 0:
        raise ValueError(_no_rows_message(data_cfg, examples, num_tokens, max_length, packing))
    logger.info(
        "training rows: %d x %d tokens, %.1f%% loss tokens",
        len(dataset), max_length, 100.0 * dataset.loss_mask.float().mean().item(),
    )
    return dataset

