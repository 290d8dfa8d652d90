"""Export a trained drafter directory to the layout a serving engine loads, check it, and load it back.

Engines load drafters by tensor *name*, and most skip names they do not know without a word: an export with one
wrong name serves a silently broken drafter. So each drafter family has an adapter (``serve/adapter.py``'s protocol)
that writes every engine's layout from that loader's source, checks a directory against it, and reads it back the
way the engine would, so the decoder can prove the export decodes exactly like the checkpoint. This module looks
the adapter up once, by the drafter's kind, and does what every export shares: refusals, the sidecar, the model
card, the atomic swap into ``output_dir``.

Kinds and engines (the adapters' own tables hold the details and the reasons for each refusal):
    eagle1       vllm / sglang (``LlamaForCausalLMEagle``), hf (SafeAILab/EAGLE): ``serve/eagle.py``
    eagle3       vllm / sglang (``LlamaForCausalLMEagle3``), speculators (the format vLLM auto-detects); hf refused
    medusa       vllm (MedusaModel), hf (FasterDecoding/Medusa); SGLang has no Medusa: ``serve/medusa.py``
    medusa2      the heads exactly as medusa + ``merged_target/`` (serve THIS, not the original) + ``adapter/``
    draft_model  a plain Hugging Face model directory for every engine: ``serve/draft_model.py``
    peagle       vllm (EAGLE-3's layout + mask_hidden, ``PeagleLlamaForCausalLM``), speculators
                 (``PEagleSpeculator``); sglang, hf refused: ``serve/peagle.py``
    lookup       nothing to export (the engines have n-gram drafting built in): refused (``serve/lookup.py``)
    dflash       vllm (``method: dflash``), sglang (``DFLASH``), speculators (``DFlashSpeculator``); hf refused:
                 ``serve/dflash.py``
The speculators format holds EAGLE-3, P-EAGLE and DFlash only (speculators 0.9.0 has no Medusa, EAGLE-1 or
draft-model class).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from distill.atomic import write_dir_atomically
from distill.fingerprint import check_digest, file_digest, write_digest
from heads.base import TargetDims
from heads.saved import load_saved_drafter, weights_digest
from serve.adapter import ENGINES, SIDECAR, ExportAdapter, refusal, serve_name
from serve.dflash import DFlashAdapter
from serve.draft_model import DraftModelAdapter
from serve.dflash2 import DFlash2Adapter
from serve.dspark import DSparkAdapter
from serve.eagle import EagleAdapter
from serve.lookup import LookupAdapter
from serve.medusa import ADAPTER_DIR, MERGED, Medusa2Adapter, MedusaAdapter
from serve.peagle import PEagleAdapter

log = logging.getLogger(__name__)

# One adapter per drafter family; a new kind adds its adapter here.
ADAPTERS: dict[str, ExportAdapter] = {kind: adapter for adapter in
                                      (MedusaAdapter(), Medusa2Adapter(), EagleAdapter(), DraftModelAdapter(),
                                       LookupAdapter(), DFlashAdapter(), PEagleAdapter(), DSparkAdapter(),
                                       DFlash2Adapter())
                                      for kind in adapter.kinds}
__all__ = ["ADAPTER_DIR", "ADAPTERS", "ENGINES", "MERGED", "SIDECAR", "adapter_for", "check_export",
           "export_drafter", "load_export", "serve_command"]


def adapter_for(kind: str) -> ExportAdapter:
    if kind not in ADAPTERS:
        raise ValueError(f"drafter kind {kind!r} has no export adapter; known kinds: {sorted(ADAPTERS)}")
    return ADAPTERS[kind]


def serve_command(engine: str, kind: str, target: str, export_dir: str, num_tokens: int, tree: dict | None = None
                  ) -> str:
    """The command the model card of a ``kind`` export for ``engine`` writes."""
    return adapter_for(kind).serve_command(engine, kind, target, export_dir, num_tokens, tree)


def _check_exportable(adapter: ExportAdapter, kind: str, config: dict, path: Path, engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"format={engine!r} is not supported; valid: {list(ENGINES)}")
    reason = refusal(adapter, engine, kind)
    if reason:
        raise ValueError(f"cannot export drafter kind {kind!r} to format={engine}: {reason}")
    if not adapter.supports(engine, kind):  # an engine added to ENGINES without a row in this kind's adapter
        raise ValueError(f"cannot export drafter kind {kind!r} to format={engine}: its export adapter has no row "
                         f"for {engine} (and no refusal); export to one of "
                         f"{[e for e in ENGINES if adapter.supports(e, kind)]}")
    trained = config.get("training", {}).get("steps") or config.get("step")
    if adapter.needs_training and not trained:
        raise ValueError(
            f"{path} holds an untrained {kind} (no training steps recorded in its config.json); export the "
            f"<run dir>/drafter written by `python -m train`, or a checkpoints/step_*/drafter"
        )


def check_output_outside_run(drafter_path: Path, output_dir: Path) -> None:
    """Refuse an ``output_dir`` that is, contains or lies inside the drafter's run dir (``<run>/drafter`` or
    ``<run>/checkpoints/step_*/drafter``; a drafter directory on its own protects itself): the export replaces
    ``output_dir`` whole, so with ``--overwrite`` it would delete the trained drafter, checkpoints and metrics."""
    drafter = drafter_path.resolve()
    if drafter.parent.parent.name == "checkpoints":
        run = drafter.parent.parent.parent
    elif any((drafter.parent / name).exists() for name in ("checkpoints", "metrics.jsonl", "report.json", ".hydra")):
        run = drafter.parent
    else:
        run = drafter
    out = output_dir.resolve()
    how = "is" if out == run else "lies inside" if run in out.parents else "contains" if out in run.parents else None
    if how:
        raise ValueError(f"output_dir={str(output_dir)!r} {how} the drafter's run dir {run}; an export replaces its "
                         f"output_dir whole, which would delete the trained drafter, checkpoints and metrics. Choose an "
                         f"output_dir outside it, e.g. exports/<name>")


def check_replaceable(output_dir: Path, overwrite: bool) -> None:
    """An export fills ``output_dir`` whole, so it may replace only what an earlier export wrote, recognised by its
    own ``SIDECAR`` marker: with ``overwrite`` an earlier export is replaced, unless files it did not write (not in
    the sidecar's ``files``) were added since; any other non-empty directory (another run, a dataset, a home
    directory) is refused, overwrite or not, and so is a file."""
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"output_dir={str(output_dir)!r} is a file, not a directory; choose a directory path, "
                              f"e.g. exports/<name>")
    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return
    if not (output_dir / SIDECAR).is_file():
        raise FileExistsError(f"output_dir={str(output_dir)!r} is not empty and is not an earlier export (it has no "
                              f"{SIDECAR}); an export replaces its output_dir whole, so it never writes over anything "
                              f"else, overwrite or not. Choose a new or empty output_dir, e.g. exports/<name>")
    if not overwrite:
        raise FileExistsError(f"output_dir={str(output_dir)!r} holds an earlier export; pass overwrite=true to "
                              f"replace it, or choose another output_dir")
    manifest = _manifest(output_dir / SIDECAR)
    if manifest is None:
        log.warning("%s lists no files (an export older than its manifest): replacing all of %s", SIDECAR, output_dir)
        return
    added = sorted(p.relative_to(output_dir).as_posix() for p in output_dir.rglob("*")
                   if p.is_file() and p.relative_to(output_dir).as_posix() not in manifest)
    if added:
        shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        raise FileExistsError(f"output_dir={str(output_dir)!r} holds an earlier export plus files it did not write "
                              f"({shown}); overwrite=true replaces only an export's own files (listed in its "
                              f"{SIDECAR}): move those files out, or choose another output_dir")
    edited = [name for name, digest in _written_digests(output_dir / SIDECAR).items()
              if (output_dir / name).is_file() and file_digest(output_dir / name) != digest]
    if edited:
        raise FileExistsError(f"output_dir={str(output_dir)!r} holds an earlier export whose {edited[0]} was edited "
                              f"since the export wrote it; overwrite=true would drop those edits: move "
                              f"{edited[0]} out (or restore it), or choose another output_dir")


# The export's files meant for people to read and edit (the model card): their sha256 is kept in the sidecar, so
# an overwrite can tell an edited one from the one it wrote.
EDITABLE = ("README.md",)


def _written_digests(sidecar: Path) -> dict[str, str]:
    """``{file: sha256}`` of the editable files as the earlier export wrote them (empty for exports before this)."""
    try:
        digests = json.loads(sidecar.read_text(encoding="utf-8")).get("written_sha256")
    except (ValueError, OSError, AttributeError):
        return {}
    return {k: v for k, v in digests.items() if isinstance(v, str)} if isinstance(digests, dict) else {}


def _manifest(sidecar: Path) -> set[str] | None:
    """The files an earlier export wrote, from its sidecar; None when it predates the list (or is unreadable)."""
    try:
        files = json.loads(sidecar.read_text(encoding="utf-8")).get("files")
    except (ValueError, OSError, AttributeError):
        return None
    return set(files) if isinstance(files, list) else None


def report_for(drafter_path: Path, report: dict | None) -> dict | None:
    """``report`` if it measured the drafter being exported (its row's ``weights_digest`` is that of
    ``drafter_path``'s weights), else None: a run extended after its evaluation keeps the old report beside the new
    drafter, whose model card must not claim the old drafter's τ and speedup."""
    if not report:
        return None
    digest = weights_digest(drafter_path)
    if any(row.get("weights_digest") == digest for row in report.get("results", [])):
        return report
    log.warning("%s does not hold a measurement of %s (its weights changed since, or it measured another drafter); "
                "the model card says 'not measured'. Evaluate this drafter (python -m eval drafter_path=%s "
                "hydra.run.dir=%s) and export again to include it", drafter_path.parent / "report.json", drafter_path,
                drafter_path, drafter_path.parent)
    return None


def export_drafter(drafter_path: str | Path, engine: str, output_dir: str | Path, overwrite: bool = False,
                   report: dict | None = None) -> Path:
    """Write ``output_dir`` for ``engine`` from the trained drafter at ``drafter_path``; returns the directory.

    The directory is filled beside the destination and swapped in at the end, so a failure never leaves half an
    export, and an existing non-empty ``output_dir`` is only replaced with ``overwrite``."""
    drafter_path, output_dir = Path(drafter_path), Path(output_dir)
    drafter, config = load_saved_drafter(drafter_path)  # refuses non-specdraft dirs, missing/extra tensors
    kind = drafter.name
    adapter = adapter_for(kind)
    _check_exportable(adapter, kind, config, drafter_path, engine)
    check_output_outside_run(drafter_path, output_dir)
    check_replaceable(output_dir, overwrite)
    report = report_for(drafter_path, report)
    target = config.get("target", {})

    def write(tmp: Path) -> None:
        adapter.write(tmp, drafter, engine, config, output_dir)
        for tensors in tensor_files(tmp):
            write_digest(tensors)  # checked by load_export; `sha256sum -c` reads them too
        (tmp / "README.md").write_text(adapter.card(engine, kind, config, output_dir, report, serve_name(config)))
        written = sorted([*(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()), SIDECAR])
        sidecar = {"engine": engine, "kind": kind, "target": target, "source": str(drafter_path.resolve()),
                   "training": config.get("training"), "drafter": config.get("drafter"), **adapter.sidecar(drafter),
                   "files": written,  # the manifest: all that overwrite=true may replace later
                   "written_sha256": {name: file_digest(tmp / name) for name in EDITABLE if (tmp / name).is_file()}}
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2, default=str))
        problems = check_export(tmp, engine, kind, target)
        if problems:
            raise RuntimeError("export failed its own conformance check:\n- " + "\n- ".join(problems))

    return write_dir_atomically(output_dir, write)


def tensor_files(path: Path) -> list[Path]:
    """The weight files of an export (safetensors, and FasterDecoding's ``.pt``), at any depth."""
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".pt", ".bin"))


def check_export(path: str | Path, engine: str, kind: str, target: dict | None = None) -> list[str]:
    """Every way ``path`` departs from what the engine's loader reads; empty when it conforms."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        return [f"{config_file} is missing"]
    return adapter_for(kind).check(path, engine, kind, json.loads(config_file.read_text()), target or {})


def load_export(path: str | Path, teacher):
    """A specdraft drafter rebuilt from an export's engine-facing files only (not from the sidecar's weights). For
    medusa2 these are the heads, to be decoded with the exported ``merged_target/`` as ``teacher``."""
    path = Path(path)
    for tensors in tensor_files(path):
        check_digest(tensors)
    sidecar = json.loads((path / SIDECAR).read_text())
    engine, kind = sidecar["engine"], sidecar["kind"]
    dims = TargetDims(teacher.hidden_size, teacher.vocab_size, teacher.num_layers)
    drafter = adapter_for(kind).load(path, engine, kind, sidecar, dims)
    drafter.bind_target(teacher, initialize=False)
    return drafter.to(teacher.device).eval()
