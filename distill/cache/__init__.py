"""Offline teacher signals: run the frozen target over the training rows once, train from disk many times.

``python -m distill.cache cache.dir=<dir> [hydra overrides]`` (``distill/cache/__main__.py``) composes the training config, builds the training rows
exactly as ``python -m train`` does (row i of the cache is row i of ``distill.data.build_train_dataset``), runs the
target over them and writes shards; ``python -m train data.teacher_cache=<dir>`` then answers the loop's
``teacher.signals(batch, layers)`` from them (``OfflineTeacher``). The real target is still loaded for the
drafter's initialisation and for evaluation.

Shape legend: N rows, T = data.max_length, D target hidden size, V vocabulary, K = cache.topk, n rows of one shard.

``shard-00000.safetensors`` ... (``cache.shard_rows`` rows each; metadata: the fingerprint and row range):
    input_ids       [n, T]     int32    (read back as int64)
    attention_mask  [n, T]     bool     (read back as int64)
    loss_mask       [n, T]     bool
    hidden.<i>      [n, T, D]  cache.dtype (bfloat16 | float32 | fp8); i = the configured hidden-state index, e.g. -1
    hidden_scale.<i> [n, T]    float32  fp8 only: each token's scale, hidden ~= float(hidden.<i>) * scale
    topk_ids        [n, T, K]  int32    the teacher's K most likely next tokens, best first
    topk_logprobs   [n, T, K]  float32  their log-probabilities under the full-vocabulary softmax; float32 whatever
                                        cache.dtype: they are small next to the hidden states
``manifest.json`` is written last, atomically: a cache without one is unfinished (rerun to resume). The target runs
in its own dtype (no autocast); ``OfflineTeacher`` hands hidden states back in that dtype, as the online teacher does.
``cache.dtype=fp8`` stores each token's hidden state as float8 e4m3 scaled by its own absolute maximum (one float32
per token and layer), about half the bytes of bfloat16 for 3 mantissa bits instead of 7.

Offline teacher logits ``[B, T, V]`` are the top-K log-probs scattered into a tensor filled with a finite floor (per
position: the smallest top-K log-prob - 1e4), so softmax(logits) is the teacher renormalised on its top K: what
``distill.losses.topk_forward_kl`` with the same k computes online. Finite, not -inf: the losses call
``F.kl_div(..., log_target=True)``, where -inf gives NaN. Forward KL, top-k FKL, JSD, TV and the LK losses (whose
acceptance Σ min(p, q) then counts the top K alone) therefore train against that truncated teacher; reverse KL, which
weighs the teacher's tail, is refused, also as the base of ``acceptance_weighted``.

The manifest's fingerprint (sha256 of the target identity, tokenizer vocabulary, data config, layers, K and dtype)
keeps its components, so a cache opened for another target or data names what differs.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import shutil
from collections import OrderedDict
from dataclasses import asdict, dataclass
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError, safe_open
from torch import Tensor
from torch.utils.data import Dataset

from distill.atomic import save_tensors, write_file_atomically, write_text_atomically
from distill.data import DataConfig, collate, source_fingerprint
from distill.fingerprint import differences, file_digest, grouped, json_digest, vocab_digest
from distill.lock import writer_lock
from distill.progress import Progress
from distill.ranks import Ranks
from distill.teacher_output import TeacherOutput

log = logging.getLogger(__name__)

FORMAT, FORMAT_VERSION = "specdraft-teacher-cache", 1


@dataclass
class CacheConfig:
    """``python -m distill.cache``: offline teacher signals (``distill.cache``); train on them with
    ``data.teacher_cache=<dir>``."""

    dir: Optional[str] = None  # required: where shards + manifest.json go
    layers: Optional[List[int]] = None  # hidden-state indices; null: the configured drafter's teacher_layers
    topk: int = 64  # teacher top-k kept per position (1..V)
    dtype: str = "bfloat16"  # hidden states on disk: bfloat16 | float32 | fp8 (e4m3 with a float32 scale per token)
    shard_rows: int = 256  # rows per shard file
    batch_size: int = 8  # rows per target forward while writing


MANIFEST = "manifest.json"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}
SCALED_DTYPES = ("fp8",)  # stored with a float32 scale per token and layer
SCALE_BYTES = 4
COLUMN_BYTES = 4 + 1 + 1  # input_ids int32, attention_mask bool, loss_mask bool
TOPK_BYTES = 4 + 4  # topk_ids int32, topk_logprobs float32
OPEN_SHARDS = 2  # shard handles kept open by a CachedDataset
WRITE_CMD = "python -m distill.cache"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def bytes_per_token(num_layers: int, hidden_size: int, topk: int, dtype: str) -> int:
    """Payload bytes one token costs on disk (safetensors headers and the manifest add a few KB in all)."""
    per_layer = hidden_size * STORE_DTYPES[dtype].itemsize + (SCALE_BYTES if dtype in SCALED_DTYPES else 0)
    return num_layers * per_layer + topk * TOPK_BYTES + COLUMN_BYTES


def quantize_fp8(hidden_BTD: Tensor) -> tuple[Tensor, Tensor]:
    """(float8 e4m3 values, float32 scale per token): each token's largest magnitude maps to e4m3's largest finite
    value, so nothing saturates and small tokens keep their relative precision."""
    h = hidden_BTD.float()
    scale_BT = h.abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (h / scale_BT[..., None]).to(torch.float8_e4m3fn), scale_BT


def dequantize_fp8(values_BTD: Tensor, scale_BT: Tensor, dtype: torch.dtype) -> Tensor:
    return (values_BTD.float() * scale_BT.float()[..., None]).to(dtype)


def _normalise(value: Any) -> Any:
    """Plain JSON types, so what is compared now equals what was stored then (DictConfig, tuples, ...)."""
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def fingerprint_components(teacher, data_cfg: DataConfig, layers: Sequence[int] = (), topk: int = 0,
                           dtype: str = "") -> dict:
    """What a cache depends on. ``target``, ``tokenizer`` and ``data`` must match when training reads the cache;
    ``layers`` / ``topk`` / ``dtype`` only when resuming a write (training may read a subset)."""
    data = _normalise(asdict(data_cfg))
    data.pop("teacher_cache", None)  # where the cache lives is not what it holds
    tokenizer = getattr(teacher, "tokenizer", None)
    vocab = vocab_digest(tokenizer) if tokenizer is not None else None
    return _normalise({"format_version": FORMAT_VERSION, "target": teacher.identity(),
                       "target_weights": teacher.weights_digest(), "tokenizer": vocab,
                       "data": data, "data_content": source_fingerprint(data_cfg), "layers": list(layers),
                       "topk": topk, "dtype": dtype})


def fingerprint(components: Mapping) -> str:
    return json_digest(components)


def _differences(stored: Mapping, current: Mapping, names: Sequence[str]) -> list[str]:
    """Human-readable differences, e.g. ``data (max_length: cached 64, now 128)``."""
    out = []
    for name, diffs in grouped(differences(stored, current, names)).items():
        if diffs[0].key is not None:
            out.append(f"{name} ({', '.join(f'{d.key}: cached {d.stored!r}, now {d.current!r}' for d in diffs)})")
        else:
            d = diffs[0]
            out.append(f"{name} (cached {d.stored!r}, now {d.current!r})" if name != "tokenizer" else f"{name} (differs)")
    return out


# --------------------------------------------------------------------------- writing


def _check_write_args(teacher, layers, topk: int, dtype: str, shard_rows: int, batch_size: int) -> list[int]:
    if dtype not in STORE_DTYPES:
        raise ValueError(f"cache.dtype={dtype!r} is not supported; valid: {sorted(STORE_DTYPES)}")
    if not 1 <= topk <= teacher.vocab_size:
        raise ValueError(f"cache.topk must be in 1..{teacher.vocab_size} (the target's vocabulary size), got {topk}")
    for key, value in (("shard_rows", shard_rows), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"cache.{key} must be >= 1, got {value}")
    layers = list(dict.fromkeys(int(i) for i in layers))  # order kept, repeats dropped
    for i in layers:
        teacher.resolve_layer(i)  # raises with the valid range
    return layers


def _topk_logprobs(logits_BTV: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """([B, T, K] float32 log-probs, [B, T, K] ids), one row at a time: the float32 log-softmax over V is the big
    temporary."""
    values, ids = [], []
    for row_TV in logits_BTV:
        top = torch.log_softmax(row_TV.float(), dim=-1).topk(k, dim=-1)
        values.append(top.values)
        ids.append(top.indices)
    return torch.stack(values), torch.stack(ids)


@torch.no_grad()
def _teacher_rows(teacher, dataset, rows: range, layers, topk: int, dtype: str, batch_size: int) -> dict:
    """Every tensor of one shard (see the module docstring), on the CPU."""
    parts = []
    for start in range(rows.start, rows.stop, batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, rows.stop))])
        out = teacher.signals({k: v.to(teacher.device) for k, v in batch.items()}, layers)
        logprobs, ids = _topk_logprobs(out.logits_BTV, topk)
        part = {"input_ids": batch["input_ids"].to(torch.int32), "attention_mask": batch["attention_mask"].bool(),
                "loss_mask": batch["loss_mask"].bool()}
        for i in layers:
            if dtype in SCALED_DTYPES:
                part[f"hidden.{i}"], part[f"hidden_scale.{i}"] = (t.cpu() for t in quantize_fp8(out.hidden[i]))
            else:
                part[f"hidden.{i}"] = out.hidden[i].to(STORE_DTYPES[dtype]).cpu()
        part.update(topk_ids=ids.to(torch.int32).cpu(), topk_logprobs=logprobs.cpu())
        parts.append(part)
    return {key: torch.cat([p[key] for p in parts]).contiguous() for key in parts[0]}


def _shard_is_complete(path: Path, fp: str, rows: range) -> bool:
    """A shard from this config with exactly ``rows``; anything else (cut short, other config) is rewritten."""
    if not path.exists():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            ok = ((f.metadata() or {}).get(FORMAT) == _shard_metadata(fp, rows)
                  and f.get_slice("input_ids").get_shape()[0] == len(rows))
    except (SafetensorError, OSError) as e:
        log.warning("%s cannot be read (%s); rewriting it", path, e)
        return False
    if not ok:
        log.warning("%s was written for another config or row range; rewriting it", path)
    return ok


def _shard_metadata(fp: str, rows: range) -> str:
    # One metadata key: safetensors keeps metadata in a hash map, so several keys come out in varying order and a
    # rewritten shard would not be byte-identical.
    return json.dumps({"fingerprint": fp, "rows": [rows.start, rows.stop]}, sort_keys=True)


def read_manifest(cache_dir: str | os.PathLike) -> dict:
    path = Path(cache_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {Path(cache_dir)} is not a finished teacher cache. Write it with "
            f"`{WRITE_CMD} cache.dir={cache_dir} <the training run's target/data overrides>` "
            f"(an interrupted write resumes where it stopped)"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} manifest; rebuild the cache with `{WRITE_CMD}`")
    return manifest


def _prepare_dir(cache_dir: Path, fp: str, components: Mapping) -> None:
    """Refuse to mix two configs' caches in one directory; drop temp files an interrupted write left."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    if (cache_dir / MANIFEST).is_file():
        old = read_manifest(cache_dir)
        if old["fingerprint"] != fp:
            diff = _differences(old["components"], components, list(components))
            raise ValueError(f"cache.dir={str(cache_dir)!r} holds a finished cache for another config (differs: "
                             f"{'; '.join(diff)}); choose another cache.dir or delete that directory")
    for tmp in cache_dir.glob(".*.tmp-*"):
        log.info("removing %s, left by an interrupted write", tmp)
        tmp.unlink()


def write_cache(cache_dir: str | os.PathLike, teacher, dataset, data_cfg: DataConfig, layers: Sequence[int],
                topk: int = 64, dtype: str = "bfloat16", shard_rows: int = 256, batch_size: int = 8,
                max_shards: int | None = None, ranks: Ranks | None = None) -> dict | None:
    """Write (or finish) the cache of ``dataset`` under ``cache_dir``; returns the manifest. Shards already complete
    for this config are kept. ``max_shards``: stop after writing that many new shards, returning None without a
    manifest (an interruption, for tests). ``ranks``: this process among several (torchrun): shard i is written by
    rank ``i mod N``, and the main rank writes the manifest once all are done; the files are the ones one process
    writes (each shard is a function of its rows)."""
    layers = _check_write_args(teacher, layers, topk, dtype, shard_rows, batch_size)
    main = ranks is None or ranks.is_main
    # One writer job: its main rank holds the lock (it sweeps temp files, which another job's would be).
    with writer_lock(cache_dir, "cache.dir") if main else contextlib.nullcontext():
        return _write_cache(Path(cache_dir), teacher, dataset, data_cfg, layers, topk, dtype, shard_rows, batch_size,
                            max_shards, ranks)


def _check_space(cache_dir: Path, needed: int) -> None:
    """Refuse to start a write the disk cannot hold (a full disk mid-write fails late and costs the time spent)."""
    free = shutil.disk_usage(cache_dir).free
    if needed > free:
        raise OSError(f"cache.dir={cache_dir}: the shards still to write need about {_size(needed)}, but only "
                      f"{_size(free)} is free there; free space, choose a cache.dir on a larger disk, or cache fewer "
                      f"rows or layers (cache.layers) or a smaller cache.topk")


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _write_cache(cache_dir: Path, teacher, dataset, data_cfg: DataConfig, layers: list[int], topk: int, dtype: str,
                 shard_rows: int, batch_size: int, max_shards: int | None, ranks: Ranks | None = None) -> dict | None:
    components = fingerprint_components(teacher, data_cfg, layers, topk, dtype)
    fp = fingerprint(components)
    rank, world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
    if rank == 0:
        _prepare_dir(cache_dir, fp, components)
    if ranks is not None:
        ranks.barrier()  # no rank writes before the main rank has swept the temp files
    if len(dataset) == 0:
        raise ValueError("the training dataset is empty; nothing to cache")
    num_rows, max_length = len(dataset), int(dataset[0]["input_ids"].shape[-1])
    per_token = bytes_per_token(len(layers), teacher.hidden_size, topk, dtype)
    total = num_rows * max_length * per_token
    size = _size(total)
    message = (f"teacher cache: {num_rows} rows x {max_length} tokens, layers {layers} (D={teacher.hidden_size}, "
               f"{dtype}), top-{topk} (int32 ids + float32 log-probs): {per_token} bytes/token, expected {size} "
               f"in {cache_dir}")
    log.info(message)
    print(message, flush=True)
    recorded = _recorded_digests(cache_dir)
    plan = [(index, range(start, min(start + shard_rows, num_rows)), cache_dir / shard_name(index))
            for index, start in enumerate(range(0, num_rows, shard_rows))]
    missing = [(index, rows, path) for index, rows, path in plan
               if not _shard_is_complete(path, fp, rows) or _damaged(path, recorded.get(path.name))]
    _check_space(cache_dir, sum(len(rows) for _, rows, _ in missing) * max_length * per_token)  # all ranks' shards
    todo = [(rows, path) for index, rows, path in missing if index % world == rank]
    progress = Progress("teacher cache", sum(len(rows) for rows, _ in todo), "rows")
    for written, (rows, path) in enumerate(todo):
        if max_shards is not None and written >= max_shards:
            log.info("stopping after %d new shard(s) (max_shards); rerun to resume", written)
            return None
        tensors = _teacher_rows(teacher, dataset, rows, layers, topk, dtype, batch_size)
        meta = {FORMAT: _shard_metadata(fp, rows)}
        write_file_atomically(path, lambda tmp, t=tensors, m=meta: save_tensors(t, tmp, metadata=m))
        log.info("wrote %s (rows %d..%d)", path.name, rows.start, rows.stop - 1)
        progress.update(len(rows), len(rows) * max_length)
    written = len(todo)
    if ranks is not None:
        ranks.barrier()  # every rank's shards are in place
    if rank != 0:
        return None
    shards = [{"file": path.name, "start": rows.start, "end": rows.stop, "bytes": path.stat().st_size,
               "sha256": file_digest(path)} for _, rows, path in plan]
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "fingerprint": fp, "components": components,
                "layers": layers, "topk": topk, "dtype": dtype, "logprob_dtype": "float32",
                "hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size, "num_rows": num_rows,
                "max_length": max_length, "bytes_per_token": per_token,
                "total_bytes": sum(s["bytes"] for s in shards), "shards": shards}
    write_text_atomically(cache_dir / MANIFEST, json.dumps(manifest, indent=2))
    log.info("teacher cache complete: %s (%d shards, %d new)", cache_dir, len(shards), written)
    return manifest


# --------------------------------------------------------------------------- reading


def _corrupt(path: Path, reason: str) -> ValueError:
    return ValueError(f"teacher cache shard {path} is truncated or corrupt ({reason}); delete it and rerun "
                      f"`{WRITE_CMD} cache.dir={path.parent} <same overrides>`, which resumes and rewrites only it")


class CachedDataset(Dataset):
    """Rows of a teacher cache, read lazily: ``__getitem__(i)`` gives row i's tensors (module docstring) with
    ``input_ids`` / ``attention_mask`` as int64, as ``distill.data.TokenBlockDataset`` does. ``.input_ids``,
    ``.attention_mask``, ``.loss_mask`` are the full ``[N, T]`` columns (read on first use) for token statistics."""

    def __init__(self, cache_dir: str | os.PathLike):
        self.dir = Path(cache_dir)
        self.manifest = read_manifest(self.dir)
        self.shards = self.manifest["shards"]
        self._starts = [s["start"] for s in self.shards]
        for s in self.shards:
            path = self.dir / s["file"]
            if not path.is_file():
                raise _corrupt(path, "missing")
            if path.stat().st_size != s["bytes"]:
                raise _corrupt(path, f"{path.stat().st_size} bytes, the manifest says {s['bytes']}")
        self._open: OrderedDict[int, Any] = OrderedDict()
        self._columns: dict[str, Tensor] = {}
        self._verified: set[int] = set()  # shards whose content matched the manifest's sha256 in this process

    @property
    def content_fingerprint(self) -> str:
        """What ``distill.data.rows_fingerprint`` records for a resume: the manifest's fingerprint and shard digests."""
        digests = [s.get("sha256") or str(s["bytes"]) for s in self.shards]
        return json_digest([self.manifest["fingerprint"], digests])[:16]

    def __len__(self) -> int:
        return self.manifest["num_rows"]

    def __getstate__(self) -> dict:  # DataLoader workers: open handles do not pickle
        return {**self.__dict__, "_open": OrderedDict()}

    def _handle(self, index: int):
        """An open shard, least recently used closed beyond ``OPEN_SHARDS``."""
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        path = self.dir / self.shards[index]["file"]
        if index not in self._verified:
            _check_shard_content(path, self.shards[index])
            self._verified.add(index)
        try:
            handle = safe_open(str(path), "pt")
        except (SafetensorError, OSError) as e:
            raise _corrupt(path, str(e)) from e
        self._open[index] = handle
        while len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return handle

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} is out of range for a cache of {len(self)} rows")
        shard = bisect.bisect_right(self._starts, index) - 1
        handle, j = self._handle(shard), index - self._starts[shard]
        try:
            names = handle.keys()  # a safe_open handle is not iterable
            item = {name: handle.get_slice(name)[j : j + 1][0] for name in names}
        except (SafetensorError, OSError) as e:
            raise _corrupt(self.dir / self.shards[shard]["file"], str(e)) from e
        item["input_ids"], item["attention_mask"] = item["input_ids"].long(), item["attention_mask"].long()
        return item

    def _column(self, name: str) -> Tensor:
        if name not in self._columns:
            parts = [self._handle(k).get_tensor(name) for k in range(len(self.shards))]
            column = torch.cat(parts)
            self._columns[name] = column.long() if name != "loss_mask" else column
        return self._columns[name]

    input_ids = property(lambda self: self._column("input_ids"))
    attention_mask = property(lambda self: self._column("attention_mask"))
    loss_mask = property(lambda self: self._column("loss_mask"))


def _recorded_digests(cache_dir: Path) -> dict[str, str]:
    """file -> sha256 from a finished cache's manifest (rewriting it must not bless a shard damaged since)."""
    if not (cache_dir / MANIFEST).is_file():
        return {}
    return {s["file"]: s["sha256"] for s in read_manifest(cache_dir)["shards"] if s.get("sha256")}


def _damaged(path: Path, digest: str | None) -> bool:
    if digest is None or not path.is_file() or file_digest(path) == digest:
        return False
    log.warning("%s differs from the sha256 its manifest recorded; rewriting it", path)
    return True




def _check_shard_content(path: Path, shard: Mapping) -> None:
    """A shard damaged in place (same size, other bytes) would train on garbage, or to NaN: compare its content with
    the digest the manifest recorded when it was written, once per shard and process. Caches written before digests
    were recorded are not checked."""
    if shard.get("sha256") and file_digest(path) != shard["sha256"]:
        raise _corrupt(path, "its content differs from the sha256 the manifest recorded when it was written (modified "
                             "or damaged since)")


class OfflineTeacher:
    """The frozen ``Teacher`` with ``signals`` answered from the cached tensors in the batch (``CachedDataset`` rows);
    everything else (``lm_head``, ``identity()``, ``__call__``, ...) is the real teacher's. Construction checks the
    cache was built for this target, tokenizer and data, and holds ``layers``."""

    def __init__(self, cache_dir: str | os.PathLike, teacher, data_cfg: DataConfig, layers: Sequence[int] = ()):
        self._teacher = teacher
        self.cache_dir = Path(cache_dir)
        self.manifest = read_manifest(self.cache_dir)
        current = fingerprint_components(teacher, data_cfg)
        names = ("target", "target_weights", "tokenizer", "data", "data_content")
        diff = _differences(self.manifest["components"], current,
                            [n for n in names if n in self.manifest["components"]])  # what older caches recorded
        if diff:
            raise ValueError(
                f"teacher cache {self.cache_dir} was built for a different {'; '.join(diff)}. Rebuild it for this "
                f"target/data with `{WRITE_CMD} cache.dir=<new dir> <this run's target/data overrides>`, or point "
                f"data.teacher_cache at a cache built for them"
            )
        self.dtype = teacher.lm_head.weight.dtype  # what the online teacher returns
        # Configured indices may differ but name the same state (-1 and L): match them resolved.
        self._keys = {teacher.resolve_layer(i): f"hidden.{i}" for i in self.manifest["layers"]}
        for i in layers:
            self._key(i)

    def __getattr__(self, name: str):
        if name == "_teacher":  # not yet set (unpickling): no delegation loop
            raise AttributeError(name)
        return getattr(self._teacher, name)

    def __call__(self, *args, **kwargs) -> TeacherOutput:
        return self._teacher(*args, **kwargs)

    def _key(self, index: int) -> str:
        resolved = self._teacher.resolve_layer(index)
        if resolved not in self._keys:
            raise ValueError(
                f"the drafter needs hidden-state layer [{index}] but teacher cache {self.cache_dir} holds only "
                f"layers {self.manifest['layers']}; rebuild it with `{WRITE_CMD} cache.dir=<new dir> "
                f"cache.layers=[...]` listing every layer the drafter's teacher_layers names"
            )
        return self._keys[resolved]

    def signals(self, batch: Mapping[str, Tensor], layers: Sequence[int] = (), dense: bool = True) -> TeacherOutput:
        """The cached top-K, sparse whatever ``dense`` asks (it is smaller than either online form)."""
        if "topk_ids" not in batch:
            raise KeyError("OfflineTeacher.signals needs a batch of CachedDataset rows (no 'topk_ids' in it); "
                           "train on CachedDataset(data.teacher_cache)")
        device = batch["input_ids"].device
        hidden = {}
        for i in layers:
            key = self._key(i)
            scale = batch.get(key.replace("hidden.", "hidden_scale.", 1))
            stored = batch[key].to(device)
            hidden[i] = stored.to(self.dtype) if scale is None else dequantize_fp8(stored, scale.to(device), self.dtype)
        return sparse_signals(batch, hidden, self._teacher.vocab_size, self.dtype)


def sparse_signals(batch: Mapping[str, Tensor], hidden: dict, vocab_size: int, dtype: torch.dtype) -> TeacherOutput:
    """The cached top-K as it is (ids + log-probs): losses expand only the rows of the chunk they work on
    (``TeacherOutput.rows``), never the whole [B, T, V]; the softmax of those rows is the teacher renormalised on
    its top K, as before."""
    device = batch["input_ids"].device
    return TeacherOutput(logits_BTV=None, hidden=hidden, topk_ids_BTK=batch["topk_ids"].to(device).long(),
                         topk_logprobs_BTK=batch["topk_logprobs"].to(device), vocab_size=vocab_size, dtype=dtype)


def check_loss(loss_cfg: Mapping | None, topk: int) -> None:
    """The cache keeps the teacher's top K only: refuse losses that need more."""
    if not loss_cfg or "_target_" not in loss_cfg:
        return
    name = str(loss_cfg["_target_"]).rpartition(".")[2]
    if name == "acceptance_weighted":  # judged by the divergence it weights (a preset name) and that one's arguments
        base = str(loss_cfg.get("base", "fkl"))
        name = {"rkl": "reverse_kl", "topk_fkl": "topk_forward_kl"}.get(base, base)
        loss_cfg = dict(loss_cfg.get("base_kwargs") or {})
    if name == "reverse_kl":
        raise ValueError("loss=rkl weighs the teacher's whole tail, but a teacher cache keeps only its top-k "
                         "(the rest sits at a -1e4 floor); use loss=fkl, topk_fkl, jsd, tvd or lk with "
                         "data.teacher_cache (or loss.base other than rkl)")
    k = int(loss_cfg.get("k", 32))  # topk_forward_kl's default
    if name == "topk_forward_kl" and k > topk:
        raise ValueError(f"loss.k={k} exceeds the teacher cache's top-{topk}; set loss.k<={topk} or rebuild the "
                         f"cache with cache.topk={k}")


def open_teacher_cache(cache_dir: str | os.PathLike, teacher, data_cfg: DataConfig, layers: Sequence[int],
                       loss_cfg: Mapping | None = None) -> tuple[CachedDataset, OfflineTeacher]:
    """(training rows, teacher answering ``signals`` from them), every check done up front."""
    offline = OfflineTeacher(cache_dir, teacher, data_cfg, layers)
    check_loss(loss_cfg, offline.manifest["topk"])
    dataset = CachedDataset(cache_dir)
    log.info("training from teacher cache %s: %d rows, layers %s, top-%d", cache_dir, len(dataset),
             offline.manifest["layers"], offline.manifest["topk"])
    return dataset, offline
