"""Regenerated data (DistillSpec): the target answers the training data's prompts; the drafter trains on its answers.

``python -m distill.regenerate regenerate.out=<file.jsonl> [hydra overrides]`` (``distill/regenerate/__main__.py``) builds the fixed training rows exactly
as ``python -m train`` does (``distill.data.build_train_dataset``), cuts a prompt from each row, lets the target
answer every prompt (``regenerate.engine``: ``distill.regenerate.engines``, greedy or sampled) and writes one jsonl line per prompt;
``python -m train data.mode=regenerated data.regenerated=<file.jsonl>`` then trains on ``load_regenerated``'s rows.

The prompt of a row: for chat rows (loss_mask False before its first True: a user turn) the tokens before the first
loss-bearing token; otherwise (text: every token loss-bearing) the first ``regenerate.prompt_tokens`` tokens. A row
whose prompt would be all of it (no answer to replace) is skipped. Answers get at most ``regenerate.max_new_tokens``
tokens; null: ``data.max_length`` - the batch's longest prompt, so no regenerated row outgrows the fixed data's.

``<out>``, one line per prompt, in prompt order (``id`` = 0, 1, ...)::

    {"id": 0, "prompt_ids": [...], "prompt_loss_mask": [...], "completion_ids": [...], "finish": "eos" | "length",
     "prompt": "<decoded prompt>", "completion": "<decoded completion>"}

``prompt_loss_mask`` is the prompt tokens' loss mask in the original data; ``completion_ids`` ends with EOS when
``finish`` is "eos". ``<out>.meta.json`` is written (atomically) before the first line: the target's identity and
weights digest (``target``, ``target_weights``), the tokenizer's vocabulary size and hash (``tokenizer_vocab_size``,
``tokenizer_sha256``), the data config (``data``), a digest of the prompts' ids and loss masks (``prompts_sha256``:
what the rows held, so a data file edited at the same path is told apart) and the regenerate settings but ``out``
(``regenerate``).

Training rows (``load_regenerated``): record ``prompt_ids + completion_ids`` with the loss mask ``prompt_loss_mask +
[True] * len(completion_ids)``, packed or padded like the fixed data (``data.packing``, ``data.max_length``). Packing
puts an EOS after an answer that does not end in one; it carries no loss (the target did not choose to stop there).

Resuming: every batch is appended and fsynced whole. A rerun with the same config checks the sidecar (another target,
tokenizer, data, prompts or setting is refused, naming it), drops a cut-off batch and continues with the next one. Batch ``k``
is always the same prompts, decoded with the seed ``regenerate.seed + k``, so an interrupted and resumed run writes
the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from distill.atomic import write_text_atomically
from distill.data import (
    DataConfig,
    TokenBlockDataset,
    _drop_rows_without_loss,
    _pad_id,
    build_train_dataset,
    pack_examples,
    regular_path,
    pad_examples,
)
from distill.fingerprint import differences, json_digest, vocab_digest
from distill.lock import writer_lock
from distill.progress import Progress
from distill.ranks import Ranks
from distill.teacher import PLACEMENTS
from distill.regenerate.engines import build_engine, check_batch_fits, check_engine, loaded_by_name, resolve_engine
from inference.sampling import SamplingConfig

log = logging.getLogger(__name__)

FORMAT, FORMAT_VERSION = "specdraft-regenerated", 1


@dataclass
class RegenerateConfig:
    """``python -m distill.regenerate``: the target answers the data's prompts (jsonl out); train on the answers with
    ``data.mode=regenerated data.regenerated=<out>``."""

    out: Optional[str] = None  # required: the jsonl to write (rerun the same command to resume)
    prompt_tokens: int = 64  # text data: each training row's first P tokens are the prompt
    max_new_tokens: Optional[int] = None  # null: data.max_length - prompt length (rows as long as the fixed data's)
    batch_size: int = 16  # prompts per batched target decode
    temperature: float = 0.0  # 0: greedy answers; > 0 samples
    top_p: float = 1.0
    seed: int = 0
    num_prompts: Optional[int] = None  # null: every prompt of the data
    # How each rank generates (distill.regenerate.engines): auto (vllm where installed on CUDA, else the engine measured
    # faster on the device: hf on CPU and CUDA) | batched (this project's batched decoder) | hf (transformers'
    # generate(), static cache + compile on CUDA) | vllm (vllm.LLM.generate; untested here)
    engine: str = "auto"
    # Where the target lives when it does not fit one device (distill.teacher.PLACEMENTS): none (a whole copy per
    # rank; the ranks share the prompts) | tensor (split over all the torchrun ranks by transformers' tensor
    # parallelism: one generation group that decodes every prompt) | device_map (one process, its layers spread over
    # every visible GPU)
    shard: str = "none"


WRITE_CMD = "python -m distill.regenerate"
FINISH_REASONS = ("eos", "length")
RECORD_KEYS = ("id", "prompt_ids", "prompt_loss_mask", "completion_ids", "finish")
# Settings that say where the answers are written and where the target lives, not what the answers are: a file
# started with the target split over ranks is finished by one process and the other way round.
PLACEMENT_KEYS = ("out", "shard")
# Data settings that choose the training mode or where outputs live, not which prompts the rows give.
NON_PROMPT_DATA_KEYS = ("teacher_cache", "mode", "regenerated", "on_policy_fraction", "on_policy_prompt_tokens",
                        "on_policy_temperature")


@dataclass(frozen=True)
class Prompt:
    """One prompt cut from a training row: its ids and their loss mask in the original data."""

    ids: list[int]
    loss_mask: list[bool]


def meta_path(out: str | os.PathLike) -> Path:
    return Path(f"{out}.meta.json")


def _plain(value: Any) -> Any:
    """Plain JSON types (DictConfig, tuples, ...), so what is compared now equals what was stored then."""
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    return json.loads(json.dumps(value, sort_keys=True, default=str))


# --------------------------------------------------------------------------- prompts


def prompts_from_data(data_cfg: DataConfig, tokenizer, prompt_tokens: int, num_prompts: int | None = None) -> list[Prompt]:
    """The prompt of every fixed training row, in row order (rule: module docstring); the first ``num_prompts``."""
    if prompt_tokens < 1:
        raise ValueError(f"regenerate.prompt_tokens must be >= 1, got {prompt_tokens}")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"regenerate.num_prompts must be >= 1 or null (all), got {num_prompts}")
    dataset = build_train_dataset(data_cfg, tokenizer)
    prompts, skipped = [], 0
    for ids_T, attention_T, mask_T in zip(dataset.input_ids, dataset.attention_mask, dataset.loss_mask):
        length = int(attention_T.sum())
        mask = mask_T[:length].tolist()
        first = mask.index(True) if True in mask else length
        cut = first if first > 0 else prompt_tokens  # chat: up to the first answer token; text: P tokens
        if cut >= length:  # nothing after the prompt: no answer to regenerate
            skipped += 1
            continue
        prompts.append(Prompt(ids=ids_T[:cut].tolist(), loss_mask=mask[:cut]))
        if num_prompts is not None and len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"data: none of the {len(dataset)} training rows leaves room for an answer after its prompt "
                         f"(regenerate.prompt_tokens={prompt_tokens}, data.max_length={dataset.input_ids.shape[1]}); "
                         f"lower regenerate.prompt_tokens or raise data.max_length")
    mean = sum(len(p.ids) for p in prompts) / len(prompts)
    log.info("regenerate: %d prompts (mean %.1f tokens) from %d rows, %d skipped without room for an answer",
             len(prompts), mean, len(dataset), skipped)
    return prompts


# --------------------------------------------------------------------------- the sidecar


def _tokenizer_fields(tokenizer) -> dict:
    if tokenizer is None:
        return {"tokenizer_vocab_size": None, "tokenizer_sha256": None}
    return {"tokenizer_vocab_size": len(tokenizer), "tokenizer_sha256": vocab_digest(tokenizer)}


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """sha256 of the prompts' ids and loss masks: the rows a regenerated file answers, whatever path they came from
    (an edited data file at the same path gives other prompts, and so another digest)."""
    return json_digest([[p.ids, p.loss_mask] for p in prompts])


def build_meta(teacher, data_cfg: DataConfig, settings: Mapping, prompts: Sequence[Prompt]) -> dict:
    """What a regenerated file depends on (module docstring); ``settings`` are ``cfg.regenerate``'s."""
    data = _plain(asdict(data_cfg))
    for key in NON_PROMPT_DATA_KEYS:
        data.pop(key, None)
    regenerate = {k: v for k, v in _plain(settings).items() if k not in PLACEMENT_KEYS}
    regenerate["engine"] = engine_of(settings, teacher)  # what ran: auto resolves per device type
    return _plain({"format": FORMAT, "format_version": FORMAT_VERSION, "target": teacher.identity(),
                   "target_weights": teacher.weights_digest(), **_tokenizer_fields(teacher.tokenizer),
                   "data": data, "prompts_sha256": prompts_digest(prompts), "regenerate": regenerate})


def engine_of(settings: Mapping, teacher) -> str:
    """The engine ``regenerate.engine`` runs on this target's device (``auto`` resolved)."""
    return resolve_engine(settings.get("engine", "auto"), teacher.device, settings.get("shard", "none"),
                          named=loaded_by_name(teacher))


def _differences(stored: Mapping, current: Mapping, names: Sequence[str]) -> list[str]:
    """Which fields differ, as ``data.max_length (file 64, now 128)``; hashes are only named."""
    return [f"{d.name}.{d.key} (file {d.stored!r}, now {d.current!r})" if d.key is not None
            else f"{d.name} (differs)" if d.name.endswith("sha256")
            else f"{d.name} (file {d.stored!r}, now {d.current!r})"
            for d in differences(stored, current, names)]


def read_meta(out: str | os.PathLike) -> dict | None:
    """``<out>.meta.json``, or None when there is none."""
    path = meta_path(out)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg}); delete it and {out}, then rerun "
                         f"`{WRITE_CMD}`") from exc


def _write_meta(out: Path, meta: Mapping) -> None:
    write_text_atomically(meta_path(out), json.dumps(meta, indent=2, sort_keys=True))


# --------------------------------------------------------------------------- writing


def check_settings(settings: Mapping) -> None:
    """``regenerate.*`` values a run could not decode with, refused before the target is loaded."""
    if int(settings["batch_size"]) < 1:
        raise ValueError(f"regenerate.batch_size must be >= 1, got {settings['batch_size']}")
    if settings.get("max_new_tokens") is not None and int(settings["max_new_tokens"]) < 1:
        raise ValueError(f"regenerate.max_new_tokens must be >= 1 or null, got {settings['max_new_tokens']}")
    if not float(settings["temperature"]) >= 0:
        raise ValueError(f"regenerate.temperature must be >= 0 (0 = greedy), got {settings['temperature']}")
    if not 0 < float(settings["top_p"]) <= 1:
        raise ValueError(f"regenerate.top_p must lie in (0, 1], got {settings['top_p']}; 1.0 disables it")
    check_engine(settings.get("engine", "auto"))
    if settings.get("shard", "none") not in PLACEMENTS:
        raise ValueError(f"regenerate.shard={settings['shard']!r}; valid: {list(PLACEMENTS)}")


def check_placement(settings: Mapping, world: int) -> None:
    """``regenerate.shard`` against the launch (``world`` ranks) and the engine, refused before the target loads."""
    shard, engine = settings.get("shard", "none"), settings.get("engine", "auto")
    if shard != "none" and engine == "vllm":
        raise ValueError(f"regenerate.shard={shard} splits the target with transformers, but regenerate.engine=vllm "
                         f"loads it in vLLM, which places it itself; use regenerate.shard=none with vllm, or "
                         f"regenerate.engine=batched|hf to split it")
    if shard == "device_map" and world > 1:
        raise ValueError(f"regenerate.shard=device_map spreads one process's target over every visible GPU, but this "
                         f"launch has {world} ranks; run it as one process (python -m distill.regenerate ...), or "
                         f"use regenerate.shard=tensor under torchrun")
    if shard == "tensor" and world < 2:
        raise ValueError("regenerate.shard=tensor splits the target over the ranks of a torchrun launch, but this is "
                         "one process; launch it with `torchrun --nproc-per-node N -m distill.regenerate ...`, or use "
                         "regenerate.shard=none (or device_map for one process over several GPUs)")


def batch_plan(total: int, batch_size: int, rank: int = 0, world: int = 1) -> list[range]:
    """The prompt ids of each batch ``rank`` decodes: batches k = rank, rank + world, ... of the single-process
    order, so batch k keeps its prompts and its seed (``regenerate.seed + k``) on any number of ranks."""
    return [range(first, min(first + batch_size, total)) for first in range(rank * batch_size, total, batch_size * world)]


def _lines_to_keep(out: Path, plan: Sequence[range], what: str = "regenerate.out") -> tuple[int, int]:
    """(whole batches to keep, their bytes) of an existing ``out`` written for ``plan``: a batch cut short is
    decoded again whole, since its seed and max_new_tokens cover the whole batch."""
    expected = [i for batch in plan for i in batch]
    lines = out.read_bytes().splitlines(keepends=True)
    kept = 0
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line) if line.endswith(b"\n") else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if record is None and number == len(lines):  # cut off mid-write
            log.info("regenerate: dropping the unfinished last line of %s", out)
            break
        if kept >= len(expected):
            raise ValueError(f"{what}={out} holds more records than the config gives prompts ({len(expected)}); "
                             f"delete the file or choose another regenerate.out")
        if not isinstance(record, dict) or record.get("id") != expected[kept]:
            raise ValueError(f"{what}={out} line {number} is not the record with id {expected[kept]} this command "
                             f"writes there; delete the file or choose another regenerate.out")
        kept += 1
    batches, records = 0, 0
    for batch in plan:
        if records + len(batch) > kept:
            break
        batches, records = batches + 1, records + len(batch)
    return batches, sum(len(line) for line in lines[:records])


def _check_sidecar(out: Path, meta: Mapping) -> None:
    stored = read_meta(out)
    if stored is None:
        raise ValueError(f"regenerate.out={out} exists without its {meta_path(out).name}, so what wrote it is unknown; "
                         f"delete the file or choose another regenerate.out")
    if stored.get("prompts_sha256") != meta["prompts_sha256"] and stored.get("data") == meta["data"]:
        data = meta["data"]
        source = f"data.path={data['path']}" if data.get("path") else f"data.source={data.get('source')}"
        raise ValueError(f"regenerate.out={out} answers other prompts than {source} gives now (the data "
                         f"was edited since, or the file predates prompt digests); regenerate into a new file "
                         f"(regenerate.out=<new file>), or delete {out} and {meta_path(out).name} to start it again")
    diff = _differences(stored, meta, list(meta))
    if diff:
        raise ValueError(f"regenerate.out={out} was started with another config (differs: {'; '.join(diff)}); delete "
                         f"{out} and {meta_path(out).name} or choose another regenerate.out")


def _prepare_out(out: Path, meta: Mapping, plan: Sequence[range], what: str = "regenerate.out") -> int:
    """Write the sidecar or check it against an existing ``out``; returns how many batches of ``plan`` it holds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir():  # never advise deleting it: it is not something this command wrote
        raise IsADirectoryError(f"{what}={out} is a directory; regenerate.out names the jsonl file to write, "
                                f"e.g. regenerate.out={out / 'regenerated.jsonl'}")
    if not out.exists():
        _write_meta(out, meta)
        out.touch()
        return 0
    _check_sidecar(out, meta)
    batches, size = _lines_to_keep(out, plan, what)
    if size < out.stat().st_size:
        log.info("regenerate: keeping %d complete batches of %s, rewriting the rest", batches, out)
        with out.open("r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
    return batches


def _record(index: int, prompt: Prompt, completion: list[int], eos: int | None, tokenizer) -> dict:
    finish = "eos" if eos is not None and completion and completion[-1] == eos else "length"
    record = {"id": index, "prompt_ids": prompt.ids, "prompt_loss_mask": prompt.loss_mask,
              "completion_ids": completion, "finish": finish}
    if tokenizer is not None:
        record.update(prompt=tokenizer.decode(prompt.ids), completion=tokenizer.decode(completion))
    return record


def _max_new_tokens(settings: Mapping, data_cfg: DataConfig, max_positions: int, prompt_len: int) -> int:
    """This batch's answer budget: the setting, else what fills ``data.max_length``; within the target's context."""
    requested = settings.get("max_new_tokens")
    if requested is None:
        n = data_cfg.max_length - prompt_len
    else:
        n = int(requested)
    if max_positions:
        n = min(n, max_positions - prompt_len)
    if n < 1:
        raise ValueError(f"a prompt of {prompt_len} tokens leaves no room to answer within data.max_length / the "
                         f"target's max_position_embeddings={max_positions}; lower regenerate.prompt_tokens")
    return n


def write_regenerated(out: str | os.PathLike, teacher, prompts: Sequence[Prompt], data_cfg: DataConfig,
                      settings: Mapping, ranks: Ranks | None = None, writer: Mapping | None = None) -> Path:
    """Decode every prompt with ``teacher`` into ``out`` (format: module docstring), resuming a started file.
    ``ranks``: this process's place among several (``distill.regenerate.ranks``); each decodes its share into a
    shard file and the main rank merges them into ``out``. ``writer``: ``distill.lock.writer_lock``'s ``what``,
    ``wait`` and ``advice`` for ``out`` (default: another writer refused at once); a wait ends reusing its answers."""
    writer = {"what": "regenerate.out", **(writer or {})}
    check_settings(settings)
    check_placement(settings, ranks.world if ranks is not None else 1)
    if prompts and engine_of(settings, teacher) != "vllm":  # before anything is written; vLLM sizes its own cache
        longest = max(len(p.ids) for p in prompts)
        check_batch_fits(teacher, settings["batch_size"], min(int(settings["batch_size"]), len(prompts)),
                         longest + _max_new_tokens(settings, data_cfg, teacher.max_positions, longest))
    if ranks is not None and ranks.world > 1:
        from distill.regenerate.ranks import write_one_group, write_sharded

        if settings.get("shard", "none") == "tensor":
            return write_one_group(Path(out), teacher, prompts, data_cfg, settings, ranks, writer)
        return write_sharded(Path(out), teacher, prompts, data_cfg, settings, ranks, writer)
    with writer_lock(out, **writer):  # one writer: two jobs appending to one file would write rows twice
        out = Path(out)
        plan = batch_plan(len(prompts), int(settings["batch_size"]))
        done = _prepare_out(out, build_meta(teacher, data_cfg, settings, prompts), plan)
        decode_batches(out, teacher, prompts, data_cfg, settings, plan, done)
        return out


def decode_batches(out: Path, teacher, prompts: Sequence[Prompt], data_cfg: DataConfig, settings: Mapping,
                   plan: Sequence[range], done: int, write: bool = True) -> None:
    """Append the records of ``plan``'s batches after the first ``done`` to ``out``, one fsynced batch at a time;
    batch k (of the single-process order) is decoded with the seed ``regenerate.seed + k``. ``write=False``: decode
    the same batches and write nothing (a rank of a tensor-parallel group other than the writer)."""
    todo = plan[done:]
    if not todo:
        log.info("regenerate: %s already holds all its %d prompts", out, sum(len(b) for b in plan))
        return
    tokenizer = teacher.tokenizer
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    sampling = SamplingConfig(temperature=float(settings["temperature"]), top_p=float(settings["top_p"]))
    name = engine_of(settings, teacher)
    engine = build_engine(name, teacher, eos, sampling)
    batch_size = int(settings["batch_size"])
    progress = Progress("regenerate", sum(len(b) for b in todo), "prompts")
    log.info("regenerate: %d prompts (%s, regenerate.engine=%s) into %s, starting at prompt %d",
             progress.total, sampling.describe(), name, out, todo[0][0])
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(out.open("ab")) if write else None
        for ids in todo:
            batch = [prompts[i] for i in ids]
            max_new = _max_new_tokens(settings, data_cfg, teacher.max_positions, max(len(p.ids) for p in batch))
            answers = engine.generate([p.ids for p in batch], max_new, int(settings["seed"]) + ids[0] // batch_size)
            if f is not None:
                lines = [_record(i, p, a, eos, tokenizer) for i, p, a in zip(ids, batch, answers)]
                f.write(b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in lines))
                f.flush()
                os.fsync(f.fileno())
            progress.update(len(batch), sum(len(a) for a in answers))
    log.info("regenerate: wrote %s", out)


def regenerated_path(teacher, data_cfg: DataConfig, settings: Mapping, prompts: Sequence[Prompt],
                     cache_root: str | os.PathLike) -> Path:
    """Where ``data.mode=regenerate`` keeps the answers for this target, data settings, prompts (the rows' content)
    and regenerate settings: named by the digest of the sidecar (``build_meta``), so a run with the same reuses the
    file and any change, an edit of the data file in place included, writes another."""
    meta = build_meta(teacher, data_cfg, settings, prompts)
    return Path(cache_root) / "regenerated" / f"{json_digest(meta)[:16]}.jsonl"


# --------------------------------------------------------------------------- reading


def _check_against(path: Path, meta: Mapping, tokenizer, teacher) -> None:
    current = _tokenizer_fields(tokenizer)
    names = ["tokenizer_vocab_size", "tokenizer_sha256"]
    if teacher is not None:
        current["target_weights"] = teacher.weights_digest()
        names.append("target_weights")
    diff = _differences(meta, current, names)
    if diff:
        raise ValueError(f"data.regenerated={path} was generated with a different {'; '.join(diff)}; regenerate it "
                         f"for this target with `{WRITE_CMD} regenerate.out=<new file>` or point data.regenerated at "
                         f"a file generated by it")


def _read_records(path: Path) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"data.regenerated: {path} line {number} is not valid JSON ({exc.msg}); an unfinished "
                                 f"file is completed by rerunning `{WRITE_CMD} regenerate.out={path}`") from exc
            missing = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
            if missing:
                raise ValueError(f"data.regenerated: {path} line {number} lacks {missing}; write the file with "
                                 f"`{WRITE_CMD}`")
            if len(record["prompt_ids"]) != len(record["prompt_loss_mask"]) or record["finish"] not in FINISH_REASONS:
                raise ValueError(f"data.regenerated: {path} line {number} has prompt_ids and prompt_loss_mask of "
                                 f"different lengths or a finish not in {FINISH_REASONS}; write the file with "
                                 f"`{WRITE_CMD}`")
            if record["id"] != len(records):  # ids run 0, 1, ...: a repeat is a second writer's, a gap a lost batch
                raise ValueError(f"data.regenerated: {path} line {number} has id {record['id']}, expected "
                                 f"{len(records)} (records are written in prompt order, each once); the file was "
                                 f"written by two jobs at once or edited. Regenerate it into a new file with "
                                 f"`{WRITE_CMD} regenerate.out=<new file>`")
            records.append(record)
    return records


def load_regenerated(path: str | os.PathLike | None, tokenizer, data_cfg: DataConfig, teacher=None) -> TokenBlockDataset:
    """Training rows from a regenerated jsonl: prompt + the target's answer per record, packed or padded like the
    fixed data (``data.packing``, ``data.max_length``); loss on the prompt as in the original data, on every answer
    token. Checked against the sidecar (tokenizer; with ``teacher``, the target's weights) when there is one."""
    if not path:
        raise ValueError(f"data.regenerated is null; set it to a jsonl written by `{WRITE_CMD} regenerate.out=<file>`")
    path = regular_path("data.regenerated", path)
    if not path.is_file():
        raise FileNotFoundError(f"data.regenerated={path} does not exist; write it with `{WRITE_CMD} "
                                f"regenerate.out={path}` (with this run's target/data overrides)")
    meta = read_meta(path)
    if meta is not None:
        _check_against(path, meta, tokenizer, teacher)
    records = _read_records(path)
    if not records:
        raise ValueError(f"data.regenerated={path} holds no records; rerun `{WRITE_CMD} regenerate.out={path}`")
    max_length, packing = data_cfg.max_length, data_cfg.packing
    eos = tokenizer.eos_token_id
    if packing and eos is None:
        raise ValueError("tokenizer: has no eos_token, needed to separate packed examples; set data.packing=false")
    examples = []
    for r in records:
        ids, mask = r["prompt_ids"] + r["completion_ids"], r["prompt_loss_mask"] + [True] * len(r["completion_ids"])
        if packing and not (r["completion_ids"] and r["completion_ids"][-1] == eos):
            # A separator only: the target did not choose to stop here, so the drafter is not taught to.
            ids, mask = ids + [eos], mask + [False]
        examples.append((ids, [bool(m) for m in mask]))
    if packing:
        dataset = pack_examples(examples, max_length)
    else:
        truncated = sum(len(ids) > max_length for ids, _ in examples)
        if truncated:
            log.info("regenerated: %d of %d examples truncated to data.max_length=%d", truncated, len(examples),
                     max_length)
        dataset = pad_examples(examples, max_length, _pad_id(tokenizer))
    dataset = _drop_rows_without_loss(dataset)
    if len(dataset) == 0:
        raise ValueError(f"data.regenerated={path}: {len(records)} records give no full row with loss tokens at "
                         f"data.max_length={max_length}; regenerate more prompts or lower data.max_length")
    log.info("regenerated rows: %d x %d tokens from %d records (%s), %.1f%% loss tokens", len(dataset), max_length,
             len(records), path, 100.0 * dataset.loss_mask.float().mean().item())
    return dataset
