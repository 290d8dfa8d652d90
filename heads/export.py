"""Export a trained drafter directory to the layout a serving engine loads, check it, and load it back.

Engines load drafters by tensor *name*, and most skip names they do not know without a word — an export with one
wrong name serves a silently broken drafter. So every (engine, drafter kind) pair has a ``Spec``: the config keys
and values its loader reads and the tensor names and shapes it accepts, each written down from the loader's source
(file named in ``Spec.loader``). ``check_export`` holds a directory to its spec; ``load_export`` reads it back the
way the engine would (by those names) so the decoder can prove the export decodes exactly like the checkpoint.

Kinds and engines:
    eagle1       vllm / sglang (``LlamaForCausalLMEagle``), hf (SafeAILab/EAGLE): see ``heads/export_eagle.py``
    eagle3       vllm / sglang (``LlamaForCausalLMEagle3``), speculators (the format vLLM auto-detects); hf refused
    medusa       vllm (MedusaModel: ``blocks.{k}.layers.{j}``, ``lm_heads.{k}``), hf (FasterDecoding/Medusa: the
                 only file its loader opens is ``medusa_lm_head.pt``); SGLang has no Medusa: refused
    medusa2      the heads exactly as medusa (vllm, hf) + ``merged_target/`` (the target with the LoRA merged in: a
                 plain HF directory with the target's tokenizer; serve THIS, not the original) + ``adapter/`` (the LoRA
                 alone, PEFT format). Writing it loads the target (on CPU), merges, and checks that the reloaded
                 merged directory reproduces the adapted target's logits
    draft_model  a plain Hugging Face model directory for every engine (vLLM and SGLang load it as a normal LM)
    lookup       nothing to export (the engines have n-gram drafting built in): refused
The speculators format holds EAGLE-3 only (speculators 0.9.0 has no Medusa, EAGLE-1 or draft-model class).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from distill.teacher import DTYPES, load_teacher, target_config
from heads import export_eagle
from distill.atomic import write_dir_atomically
from heads.base import TargetDims, load_saved_drafter, weights_digest
from heads.draft_model import DraftModel
from heads.export_eagle import EAGLE_KINDS
from heads.lora import save_peft_adapter
from heads.medusa import MedusaHeads
from heads.model_card import medusa2_card, model_card

log = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang", "speculators", "hf")
SIDECAR = "specdraft_export.json"  # target identity and provenance, beside the engine's own files
MEDUSA_KINDS = ("medusa", "medusa2")  # kinds whose heads use the Medusa specs below
MERGED, ADAPTER_DIR = "merged_target", "adapter"  # medusa2: the merged target and the PEFT adapter, inside the export


@dataclass(frozen=True)
class Spec:
    """What one engine's loader reads for one drafter kind. Shapes use symbols resolved from the export's sizes:
    D hidden size, V vocabulary, K heads, L residual layers per head."""

    engine: str
    kind: str
    loader: str  # the source file(s) the names and keys below were read from
    weights: str  # the safetensors file name the loader opens
    config: dict[str, Any]  # key -> required value, or a size symbol ("D", "V", "K", "L")
    tensors: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (name regex, shape symbols)


MEDUSA_VLLM = Spec(
    engine="vllm", kind="medusa",
    loader="vllm/model_executor/models/medusa.py (Medusa, ResidualBlock, load_weights); "
           "vllm/transformers_utils/configs/medusa.py (MedusaConfig)",
    weights="model.safetensors",
    # medusa_fc_bias defaults to False in vLLM: without it the blocks are built bias-free and our biases are
    # skipped silently. original_lm_head=False: one lm_head per head, as trained.
    config={"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": "D", "vocab_size": "V",
            "truncated_vocab_size": "V", "num_heads": "K", "num_hidden_layers": "L", "medusa_fc_bias": True,
            "original_lm_head": False},
    tensors=[(r"blocks\.(\d+)\.layers\.(\d+)\.weight", ("D", "D")), (r"blocks\.(\d+)\.layers\.(\d+)\.bias", ("D",)),
             (r"lm_heads\.(\d+)\.weight", ("V", "D"))],
)
MEDUSA_HF = Spec(
    engine="hf", kind="medusa",
    loader="FasterDecoding/Medusa medusa/model/medusa_model.py (MedusaModelABC.from_pretrained, MedusaConfig)",
    # The loader opens <dir>/medusa_lm_head.pt with torch.load (else it asks the hub for that file), and no other
    # name. It reads medusa_num_layers and base_model_name_or_path through MedusaConfig. The config deliberately has
    # no model_type: the loader first tries AutoConfig on the export dir and, when that succeeds, loads a whole LLM
    # from it; without one it takes its heads-only path (the layout of FasterDecoding's own hub checkpoints).
    weights="medusa_lm_head.pt",
    config={"medusa_num_heads": "K", "medusa_num_layers": "L", "hidden_size": "D", "vocab_size": "V"},
    tensors=[(r"(\d+)\.(\d+)\.linear\.weight", ("D", "D")), (r"(\d+)\.(\d+)\.linear\.bias", ("D",)),
             (r"(\d+)\.(\d+)\.weight", ("V", "D"))],
)
SPECS = {("vllm", "medusa"): MEDUSA_VLLM, ("hf", "medusa"): MEDUSA_HF}
FASTERDECODING_HEADS = 5  # MedusaModelABC.from_pretrained sets medusa_num_heads = 5 whatever the config says
_NO_SGLANG_MEDUSA = ("SGLang has no Medusa drafter (its --speculative-algorithm choices are EAGLE, EAGLE3, NEXTN, "
                     "STANDALONE, NGRAM); serve {} with vLLM (format=vllm)")
REFUSED = {
    ("sglang", "medusa"): _NO_SGLANG_MEDUSA.format("Medusa"),
    ("sglang", "medusa2"): _NO_SGLANG_MEDUSA.format("Medusa-2"),
    **export_eagle.REFUSED,
    **{("speculators", kind): f"the speculators format holds EAGLE-3 drafters only (speculators 0.9.0 has no {kind} "
                              f"model class); serve {kind} with format=vllm"
       for kind in ("medusa", "medusa2", "draft_model")},
    ("*", "lookup"): "prompt lookup has no weights: vLLM serves it with --speculative-config "
                     "'{\"method\": \"ngram\", ...}' and SGLang with --speculative-algorithm NGRAM",
}


# --- medusa: our names <-> the engines' names ------------------------------------------------------------------


def _medusa_sizes(state: dict[str, torch.Tensor]) -> dict[str, int]:
    K = 1 + max(int(k.split(".")[1]) for k in state)
    L = sum(1 for k in state if k.startswith("heads.0.") and k.endswith("linear.weight"))
    D, V = state["heads.0.%d.weight" % L].shape[1], state["heads.0.%d.weight" % L].shape[0]
    return {"K": K, "L": L, "D": D, "V": V}


def _medusa_names(engine: str, L: int) -> Callable[[str], str]:
    """heads.{k}.{j}.linear.{weight,bias} (ResBlock j) and heads.{k}.{L}.weight (the head's lm_head) -> engine."""
    def rename(name: str) -> str:
        _, k, j, *rest = name.split(".")
        if engine == "hf":  # FasterDecoding saves medusa_head.state_dict(): the same Sequential layout, no prefix
            return ".".join([k, j, *rest])
        if int(j) == L:
            return f"lm_heads.{k}.weight"
        return f"blocks.{k}.layers.{j}.{rest[-1]}"
    return rename


def _medusa_config(spec: Spec, sizes: dict[str, int], base_model: str) -> dict:
    config = {key: sizes[value] if _is_size(value) else value for key, value in spec.config.items()}
    if spec.engine == "hf":
        config["base_model_name_or_path"] = base_model
    return config


def _write_medusa(tmp: Path, drafter, kind: str, engine: str, config: dict, output_dir: Path) -> None:
    spec = SPECS[(engine, "medusa")]
    # medusa2's state also holds its LoRA (lora.*): that goes into merged_target/ and adapter/ below.
    dtype = target_dtype(config)
    state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items() if k.startswith("heads.")}
    sizes = _medusa_sizes(state)
    if engine == "hf" and sizes["L"] > 1:
        # FasterDecoding builds each head as [ResBlock] * L: one block shared L times. Distinct trained
        # blocks cannot be expressed in that layout.
        raise ValueError(f"format=hf (FasterDecoding/Medusa) shares one ResBlock per head, but this drafter "
                         f"has num_layers={sizes['L']} distinct blocks; export with format=vllm instead")
    if engine == "hf" and sizes["K"] > FASTERDECODING_HEADS:
        raise ValueError(f"format=hf (FasterDecoding/Medusa) always builds {FASTERDECODING_HEADS} heads and would drop "
                         f"heads {FASTERDECODING_HEADS}..{sizes['K'] - 1} without a word (strict=False); export with "
                         f"format=vllm, or train drafter.num_heads <= {FASTERDECODING_HEADS}")
    rename = _medusa_names(engine, sizes["L"])
    renamed = {rename(k): v for k, v in state.items()}
    if engine == "hf":  # FasterDecoding's loader reads this file name only, with torch.load
        torch.save(renamed, tmp / spec.weights)
    else:
        save_file(renamed, str(tmp / spec.weights), metadata={"format": "pt"})
    engine_config = _medusa_config(spec, sizes, serve_name(config))
    if kind == "medusa2":
        _write_merged_target(drafter, config, tmp)
        if engine == "hf":  # FasterDecoding loads its base model from here: the merged target
            engine_config["base_model_name_or_path"] = str(output_dir.resolve() / MERGED)
    (tmp / "config.json").write_text(json.dumps(engine_config, indent=2))


def _write_eagle(tmp: Path, drafter, engine: str, config: dict) -> None:
    kind = drafter.variant
    facts = target_facts(config)
    export_eagle.check_target_family(engine, kind, facts.get("model_type"))
    dtype = target_dtype(config)
    target = {**config.get("target", {}), **facts, "serve_name": serve_name(config)}
    num_tokens = drafter.depth or 4
    engine_config = export_eagle.engine_config(drafter, engine, target, str(dtype).removeprefix("torch."), num_tokens)
    save_file(export_eagle.engine_state(drafter, engine, dtype), str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(engine_config, indent=2))


def target_dtype(config: dict) -> torch.dtype:
    """The dtype the target was trained against (target.dtype): heads are served in the target's dtype."""
    return DTYPES[(config.get("target_config") or {}).get("dtype", "float32")]


def serve_name(config: dict) -> str:
    """What a serving engine can resolve as the target: the hub id, or for the embedded toy target the local
    directory it is cached in (``specdraft/tiny-stdlib`` names no hub repository)."""
    target_cfg = config.get("target_config") or {}
    if target_cfg.get("source") == "toy" and target_cfg.get("toy"):
        from distill.toy import toy_cache_path

        return str(toy_cache_path(target_cfg["toy"], target_cfg.get("cache_dir")).resolve())
    return str(target_cfg.get("name") or config.get("target", {}).get("name"))


def target_facts(config: dict) -> dict:
    """model_type (the engines whitelist EAGLE-3 targets by it), architecture and max_positions (the drafter's
    config must not cap the served context below the target's) of the target, read from its config.json when it
    can be resolved here (a local dir, or the hub cache); the toy target is a Llama."""
    target_cfg = config.get("target_config") or {}
    if target_cfg.get("source") == "toy":
        return {"model_type": "llama", "architecture": "LlamaForCausalLM",
                "max_positions": (target_cfg.get("toy") or {}).get("max_seq_len")}
    recorded = {"model_type": (config.get("target") or {}).get("model_type")}  # saved by training (older drafters lack it)
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(target_cfg.get("name"), revision=target_cfg.get("revision"))
    except (OSError, ValueError, TypeError) as e:
        if recorded["model_type"] is None:
            log.warning("could not read the target's config (%s): its model family is not checked against the "
                        "engines' EAGLE support, and the drafter config says max_position_embeddings=4096", e)
        return recorded
    return {"model_type": hf.model_type, "architecture": (hf.architectures or [None])[0],
            "max_positions": getattr(hf, "max_position_embeddings", None)}


# --- export ----------------------------------------------------------------------------------------------------


def _check_exportable(kind: str, config: dict, path: Path, engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"format={engine!r} is not supported; valid: {list(ENGINES)}")
    reason = REFUSED.get((engine, kind)) or REFUSED.get(("*", kind))
    if reason:
        raise ValueError(f"cannot export drafter kind {kind!r} to format={engine}: {reason}")
    trained = config.get("training", {}).get("steps") or config.get("step")
    if kind != "draft_model" and not trained:
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
    own ``SIDECAR`` marker: with ``overwrite`` an earlier export is replaced; any other non-empty directory (another
    run, a dataset, a home directory) is refused, overwrite or not, and so is a file."""
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
    _check_exportable(kind, config, drafter_path, engine)
    check_output_outside_run(drafter_path, output_dir)
    check_replaceable(output_dir, overwrite)
    report = report_for(drafter_path, report)
    target = config.get("target", {})

    def write(tmp: Path) -> None:
        if kind in MEDUSA_KINDS:
            _write_medusa(tmp, drafter, kind, engine, config, output_dir)
        elif kind in EAGLE_KINDS:
            _write_eagle(tmp, drafter, engine, config)
        else:  # a draft LM: the same plain HF directory serves vLLM, SGLang and transformers
            drafter.model.save_pretrained(tmp, safe_serialization=True)
            _copy_tokenizer(config.get("target_config", {}), tmp)
        sidecar = {"engine": engine, "kind": kind, "target": target, "source": str(drafter_path.resolve()),
                   "training": config.get("training"), "drafter": config.get("drafter")}
        if kind == "medusa2":
            sidecar.update(merged_target=MERGED, adapter=ADAPTER_DIR, verifies_against=drafter.verifies_against)
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2, default=str))
        card = (medusa2_card(engine, config, output_dir, report, serve_name(config), MERGED, ADAPTER_DIR)
                if kind == "medusa2" else model_card(engine, kind, config, output_dir, report, serve_name(config)))
        (tmp / "README.md").write_text(card)
        problems = check_export(tmp, engine, kind, target)
        if problems:
            raise RuntimeError("export failed its own conformance check:\n- " + "\n- ".join(problems))

    return write_dir_atomically(output_dir, write)


def _write_merged_target(drafter, config: dict, out: Path) -> None:
    """medusa2: ``adapter/`` (the LoRA in PEFT's format) and ``merged_target/`` (the target with the LoRA merged in,
    ``save_pretrained`` + the target's tokenizer), then proof that the reloaded directory computes what the adapted
    target computed. Loads the target named in the drafter's config (on CPU, in its configured dtype)."""
    from transformers import AutoModelForCausalLM

    target_cfg = config.get("target_config") or {}
    teacher = load_teacher(target_config(target_cfg))
    drafter.attach(teacher)
    n = min(32, teacher.max_positions or 32)
    probe = torch.randint(0, teacher.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = teacher.model(input_ids=probe, use_cache=False).logits
    save_peft_adapter(out / ADAPTER_DIR, drafter.lora_spec, "drafter.lora", drafter.lora_weights(),
                      target_cfg.get("name"))
    drafter.merge_into_target(teacher)
    teacher.model.save_pretrained(out / MERGED, safe_serialization=True)
    if teacher.tokenizer is not None:
        teacher.tokenizer.save_pretrained(out / MERGED)
    del teacher  # one copy of the target in memory at a time
    reloaded = AutoModelForCausalLM.from_pretrained(out / MERGED, dtype=adapted.dtype).eval()
    with torch.no_grad():
        got = reloaded(input_ids=probe, use_cache=False).logits
    problem = _logits_mismatch(got, adapted)
    if problem:
        raise RuntimeError(f"{MERGED}/ does not reproduce the adapted target it was merged from: {problem}")


def _logits_mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` matches ``want`` up to the rounding merging causes: 1e-4 (relative to the largest logit) in
    float32; 2e-2 in 16-bit dtypes, where W + B·A is rounded once more than W x + B(A x)."""
    diff = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    tol = 1e-4 if want.dtype == torch.float32 else 2e-2
    return None if diff <= tol * scale else f"max |logit difference| {diff:.3g} > {tol:g} x {scale:.3g}"


def _copy_tokenizer(target_cfg: dict, out: Path) -> None:
    """The target's tokenizer files, when they are on this machine (the toy target's cache); else the model card
    says to use the target's."""
    if target_cfg.get("source") != "toy":
        return
    from distill.toy import toy_cache_path

    src = toy_cache_path(target_cfg["toy"], target_cfg.get("cache_dir"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


# --- conformance -----------------------------------------------------------------------------------------------


def check_export(path: str | Path, engine: str, kind: str, target: dict | None = None) -> list[str]:
    """Every way ``path`` departs from what the engine's loader reads; empty when it conforms."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        return [f"{config_file} is missing"]
    config = json.loads(config_file.read_text())
    if kind == "draft_model":
        return _check_hf_model(path, config, target or {})
    if kind == "medusa2":
        return _check_medusa2(path, engine, target)
    if kind in EAGLE_KINDS:
        return _check_eagle(path, engine, kind, config, target or {})
    spec = SPECS[(engine, kind)]
    weights = path / spec.weights
    if not weights.is_file():
        return [f"{weights} is missing ({spec.loader} opens it)"]
    sizes = {sym: config.get(key) for key, sym in spec.config.items() if _is_size(sym)}
    problems = [f"config.json {key}={config.get(key)!r}, expected {want!r}" for key, want in spec.config.items()
                if not _is_size(want) and config.get(key) != want]
    problems += [f"config.json lacks {key}" for key, sym in spec.config.items() if _is_size(sym) and sizes[sym] is None]
    if target and sizes.get("V") not in (None, target.get("vocab_size")):
        problems.append(f"vocab_size={sizes['V']} differs from the target's {target.get('vocab_size')}")
    if problems:
        return problems
    return problems + _check_tensors(_read_weights(weights), spec, sizes)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".pt":  # FasterDecoding's torch.save'd dict of tensors: weights only, no code
        return torch.load(path, map_location="cpu", weights_only=True)
    return load_file(str(path))


def _check_eagle(path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
    """The config keys the engine reads, then the export run through the engine loader's own name mapping: every
    tensor lands on a parameter, every parameter is set, shapes agree, d2t maps into the vocabulary."""
    weights = path / "model.safetensors"
    if not weights.is_file():
        return [f"{weights} is missing ({export_eagle.LOADERS[(engine, kind)]} reads it)"]
    want = export_eagle.ARCHITECTURES[(engine, kind)]
    problems = [] if config.get("architectures") == want else [
        f"config.json architectures={config.get('architectures')!r}, expected {want!r}"]
    layer_cfg = config.get("transformer_layer_config", config)
    if target and layer_cfg.get("vocab_size") != target.get("vocab_size"):
        problems.append(f"vocab_size={layer_cfg.get('vocab_size')} differs from the target's {target.get('vocab_size')}")
    if kind == "eagle3":
        ids = export_eagle.written_layer_ids(engine, config)
        if not ids or len(ids) != 3:
            problems.append(f"eagle_aux_hidden_state_layer_ids={ids!r}: {engine} needs the 3 target layers "
                            f"({'nested in eagle_config' if engine == 'sglang' else 'top level'})")
        if "norm_before_residual" not in config:
            problems.append("config.json lacks norm_before_residual (the residual convention must be explicit)")
    state = load_file(str(weights))
    _, vocab, mapped = export_eagle.load_like_engine(engine, kind, state, config)
    problems += mapped
    if vocab is not None and not (vocab.min() >= 0 and vocab.max() < layer_cfg["vocab_size"]
                                  and vocab.unique().numel() == vocab.numel()):
        problems.append("d2t offsets do not map the draft vocabulary onto distinct target ids")
    if "t2d" in state and state["t2d"].dtype != torch.bool:
        problems.append(f"t2d has dtype {state['t2d'].dtype}; the loaders expect bool")
    return problems


def _check_medusa2(path: Path, engine: str, target: dict | None) -> list[str]:
    """The heads as medusa, plus a loadable merged target and a complete PEFT adapter directory."""
    problems = check_export(path, engine, "medusa", target)
    merged = path / MERGED
    if not (merged / "config.json").is_file():
        problems.append(f"{merged / 'config.json'} is missing (the merged target to serve)")
    else:
        config = json.loads((merged / "config.json").read_text())
        problems += [f"{MERGED}/: {p}" for p in _check_hf_model(merged, config, target or {})]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / ADAPTER_DIR / name).is_file():
            problems.append(f"{path / ADAPTER_DIR / name} is missing (the LoRA in PEFT's format)")
    return problems


def _is_size(value: Any) -> bool:
    return isinstance(value, str) and value in ("D", "V", "K", "L")


def _check_tensors(state: dict[str, torch.Tensor], spec: Spec, sizes: dict[str, int]) -> list[str]:
    problems, seen = [], []
    for name, tensor in state.items():
        match = next(((rx, shape) for rx, shape in spec.tensors if re.fullmatch(rx, name)), None)
        if match is None:
            problems.append(f"tensor {name!r} matches no name {spec.loader} loads: it would be skipped")
            continue
        want = tuple(sizes[s] for s in match[1])
        if tuple(tensor.shape) != want:
            problems.append(f"tensor {name!r} has shape {tuple(tensor.shape)}, the loader expects {want}")
        if not tensor.dtype.is_floating_point:
            problems.append(f"tensor {name!r} has dtype {tensor.dtype}; expected a float type")
        seen.append(match[0])
    K, L = sizes["K"], sizes["L"]
    expected = {spec.tensors[0][0]: K * L, spec.tensors[1][0]: K * L, spec.tensors[2][0]: K}
    for rx, count in expected.items():
        if seen.count(rx) != count:
            problems.append(f"{seen.count(rx)} tensors match {rx}, expected {count} (K={K} heads, L={L} layers)")
    return problems


def _check_hf_model(path: Path, config: dict, target: dict) -> list[str]:
    """A plain HF causal LM: loading it as transformers does (its checkpoint-name conversions included: GPT-NeoX's
    ``embed_out``, MoE experts saved one by one) must leave no tensor missing, unexpected or mis-shaped."""
    from transformers import AutoModelForCausalLM

    problems = [f"config.json lacks {key}" for key in ("architectures", "model_type", "vocab_size") if key not in config]
    if target and config.get("vocab_size") != target.get("vocab_size"):
        problems.append(f"vocab_size={config.get('vocab_size')} differs from the target's {target.get('vocab_size')}")
    files = sorted(path.glob("*.safetensors"))
    if problems or not files:
        return problems + ([] if files else [f"{path} has no *.safetensors weights"])
    try:
        _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    except (RuntimeError, ValueError, OSError) as e:  # e.g. MoE experts that cannot be fused back: not loadable
        return problems + [f"transformers cannot load it: {e}"]
    name = config["architectures"][0]
    problems += [f"tensor {k!r} is not part of {name}" for k in sorted(info.get("unexpected_keys") or [])]
    problems += [f"tensor {k!r} is missing" for k in sorted(info.get("missing_keys") or [])]
    problems += [f"tensor {m[0] if isinstance(m, (tuple, list)) else m!r} has the wrong shape"
                 for m in sorted(info.get("mismatched_keys") or [], key=str)]
    return problems


# --- round trip: read an export the way the engine does --------------------------------------------------------


def load_export(path: str | Path, teacher):
    """A specdraft drafter rebuilt from an export's engine-facing files only (not from the sidecar's weights). For
    medusa2 these are the heads, to be decoded with the exported ``merged_target/`` as ``teacher``."""
    path = Path(path)
    sidecar = json.loads((path / SIDECAR).read_text())
    engine, kind = sidecar["engine"], sidecar["kind"]
    dims = TargetDims(teacher.hidden_size, teacher.vocab_size, teacher.num_layers)
    if kind == "draft_model":
        from transformers import AutoModelForCausalLM

        drafter = DraftModel(dims, model=AutoModelForCausalLM.from_pretrained(path))
    elif kind in EAGLE_KINDS:
        config = json.loads((path / "config.json").read_text())
        params, vocab, problems = export_eagle.load_like_engine(engine, kind, load_file(str(path / "model.safetensors")),
                                                                config)
        if problems:
            raise ValueError(f"{path} does not load into {engine}'s {kind}: " + "; ".join(problems))
        saved = sidecar["drafter"]
        decode = {k: saved[k] for k in ("tree", "top_k", "depth", "total_tokens") if k in saved}
        layers = export_eagle.our_layers(engine, kind, config)
        drafter = export_eagle.drafter_from_engine(engine, kind, params, vocab, config, dims, layers, decode)
    else:
        spec = SPECS[(engine, "medusa")]
        config = json.loads((path / "config.json").read_text())
        K, L = config[_key(spec, "K")], config[_key(spec, "L")]
        drafter = MedusaHeads(dims, num_heads=K, num_layers=L, tree=sidecar["drafter"].get("tree"))
        rename = _medusa_names(engine, L)
        state = _read_weights(path / spec.weights)
        drafter.load_state_dict({k: state[rename(k)] for k in drafter.state_dict()}, strict=True)
    drafter.bind_target(teacher, initialize=False)
    return drafter.to(teacher.device).eval()


def _key(spec: Spec, symbol: str) -> str:
    return next(key for key, sym in spec.config.items() if sym == symbol)
