"""Medusa and Medusa-2 heads to the engines that serve them: vLLM's ``MedusaModel`` and FasterDecoding/Medusa.

    medusa   vllm (MedusaModel: ``blocks.{k}.layers.{j}``, ``lm_heads.{k}``), hf (FasterDecoding/Medusa: the only file
             its loader opens is ``medusa_lm_head.pt``); SGLang has no Medusa: refused
    medusa2  the heads exactly as medusa + ``merged_target/`` (the target with the LoRA merged in: a plain HF directory
             with the target's tokenizer; serve THIS, not the original) + ``adapter/`` (the LoRA alone, PEFT format).
             Writing it loads the target (on CPU), merges, and checks that the reloaded merged directory reproduces
             the adapted target's logits

Engines load heads by tensor *name* and skip names they do not know without a word, so each engine is a ``Spec``:
the config keys and values its loader reads and the tensor names and shapes it accepts, each written down from the
loader's source (``Spec.loader``). One ``Spec`` per engine: adding an engine is one row in ``SPECS``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from distill.atomic import save_tensors, save_torch
from distill.teacher import load_teacher, target_config
from heads.base import TargetDims
from heads.lora import save_peft_adapter
from heads.medusa.model import MedusaHeads
from serve.adapter import check_hf_model, read_weights, serve_name, target_dtype
from serve.model_card import model_card

MERGED, ADAPTER_DIR = "merged_target", "adapter"  # medusa2: the merged target and the PEFT adapter, inside the export
FASTERDECODING_HEADS = 5  # MedusaModelABC.from_pretrained sets medusa_num_heads = 5 whatever the config says


def _save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    save_tensors(state, path, metadata={"format": "pt"})


def _save_torch(state: dict[str, torch.Tensor], path: Path) -> None:
    save_torch(state, path)  # FasterDecoding's loader reads this file name only, with torch.load


def _vllm_name(k: str, j: str, rest: list[str], L: int) -> str:
    return f"lm_heads.{k}.weight" if int(j) == L else f"blocks.{k}.layers.{j}.{rest[-1]}"


def _fasterdecoding_name(k: str, j: str, rest: list[str], L: int) -> str:
    return ".".join([k, j, *rest])  # FasterDecoding saves medusa_head.state_dict(): the same Sequential layout


def _vllm_serve(target: str, export_dir: str, num_tokens: int) -> str:
    spec = {"method": "medusa", "model": export_dir, "num_speculative_tokens": num_tokens}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def _fasterdecoding_serve(target: str, export_dir: str, num_tokens: int) -> str:
    return f"python -m medusa.inference.cli --model {export_dir}"  # base_model_name_or_path is in its config


def _no_limits(sizes: dict[str, int]) -> None:
    return None


def _fasterdecoding_limits(sizes: dict[str, int]) -> None:
    if sizes["L"] > 1:
        # FasterDecoding builds each head as [ResBlock] * L: one block shared L times. Distinct trained
        # blocks cannot be expressed in that layout.
        raise ValueError(f"format=hf (FasterDecoding/Medusa) shares one ResBlock per head, but this drafter "
                         f"has num_layers={sizes['L']} distinct blocks; export with format=vllm instead")
    if sizes["K"] > FASTERDECODING_HEADS:
        raise ValueError(f"format=hf (FasterDecoding/Medusa) always builds {FASTERDECODING_HEADS} heads and would drop "
                         f"heads {FASTERDECODING_HEADS}..{sizes['K'] - 1} without a word (strict=False); export with "
                         f"format=vllm, or train drafter.num_heads <= {FASTERDECODING_HEADS}")


def _vllm_note(drafter: dict) -> list[str]:
    return ["vLLM drafts Medusa as a top-1 chain of `num_speculative_tokens` heads (it needs at least that many); the "
            "figures above were measured with specdraft's decoder and the drafter's own decoding setting (tree: "
            f"`{drafter.get('tree')}`), so expect the chain's τ, not a tree's.", ""]


def _fasterdecoding_note(drafter: dict) -> list[str]:
    return ["FasterDecoding/Medusa's loader reads only `medusa_lm_head.pt` and always builds 5 heads (it overrides "
            "medusa_num_heads): with fewer trained heads the rest start untrained, so pass `medusa_choices` no deeper "
            f"than {drafter.get('num_heads')} heads. It shares one ResBlock across a head's layers, so only "
            "`num_layers: 1` heads export to it. Its `medusa_generate` uses typical acceptance (not lossless).", ""]


@dataclass(frozen=True)
class Spec:
    """What one engine's loader reads for Medusa heads. Shapes use symbols resolved from the export's sizes:
    D hidden size, V vocabulary, K heads, L residual layers per head."""

    engine: str
    loader: str  # the source file(s) the names and keys below were read from
    weights: str  # the file name the loader opens
    config: dict[str, Any]  # key -> required value, or a size symbol ("D", "V", "K", "L")
    tensors: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (name regex, shape symbols)
    name: Callable[[str, str, list[str], int], str] = _vllm_name  # (head k, layer j, rest, L) -> the engine's name
    save: Callable[[dict[str, torch.Tensor], Path], None] = _save_safetensors
    base_model_key: str | None = None  # the config key the loader reads the (merged) target from
    limits: Callable[[dict[str, int]], None] = _no_limits  # raises for heads the layout cannot express
    serve: Callable[[str, str, int], str] = _vllm_serve  # (target, export dir, num tokens) -> command
    note: Callable[[dict], list[str]] = lambda drafter: []  # the model card's note for this engine


SPECS = {spec.engine: spec for spec in [
    Spec(
        engine="vllm",
        loader="vllm/model_executor/models/medusa.py (Medusa, ResidualBlock, load_weights); "
               "vllm/transformers_utils/configs/medusa.py (MedusaConfig)",
        weights="model.safetensors",
        # medusa_fc_bias defaults to False in vLLM: without it the blocks are built bias-free and our biases are
        # skipped silently. original_lm_head=False: one lm_head per head, as trained.
        config={"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": "D", "vocab_size": "V",
                "truncated_vocab_size": "V", "num_heads": "K", "num_hidden_layers": "L", "medusa_fc_bias": True,
                "original_lm_head": False},
        tensors=[(r"blocks\.(\d+)\.layers\.(\d+)\.weight", ("D", "D")),
                 (r"blocks\.(\d+)\.layers\.(\d+)\.bias", ("D",)), (r"lm_heads\.(\d+)\.weight", ("V", "D"))],
        note=_vllm_note,
    ),
    Spec(
        engine="hf",
        loader="FasterDecoding/Medusa medusa/model/medusa_model.py (MedusaModelABC.from_pretrained, MedusaConfig)",
        # The loader opens <dir>/medusa_lm_head.pt with torch.load (else it asks the hub for that file), and no other
        # name. It reads medusa_num_layers and base_model_name_or_path through MedusaConfig. The config deliberately
        # has no model_type: the loader first tries AutoConfig on the export dir and, when that succeeds, loads a
        # whole LLM from it; without one it takes its heads-only path (the layout of FasterDecoding's hub checkpoints).
        weights="medusa_lm_head.pt",
        config={"medusa_num_heads": "K", "medusa_num_layers": "L", "hidden_size": "D", "vocab_size": "V"},
        tensors=[(r"(\d+)\.(\d+)\.linear\.weight", ("D", "D")), (r"(\d+)\.(\d+)\.linear\.bias", ("D",)),
                 (r"(\d+)\.(\d+)\.weight", ("V", "D"))],
        name=_fasterdecoding_name, save=_save_torch, base_model_key="base_model_name_or_path",
        limits=_fasterdecoding_limits, serve=_fasterdecoding_serve, note=_fasterdecoding_note,
    ),
]}
_NO_SGLANG = ("SGLang has no Medusa drafter (its --speculative-algorithm choices are EAGLE, EAGLE3, NEXTN, "
              "STANDALONE, NGRAM); serve {} with vLLM (format=vllm)")
_NO_SPECULATORS = ("the speculators format holds EAGLE-3 drafters only (speculators 0.9.0 has no {0} model class); "
                   "serve {0} with format=vllm")


def _is_size(value: Any) -> bool:
    return isinstance(value, str) and value in ("D", "V", "K", "L")


def _key(spec: Spec, symbol: str) -> str:
    return next(key for key, sym in spec.config.items() if sym == symbol)


def _sizes(state: dict[str, torch.Tensor]) -> dict[str, int]:
    K = 1 + max(int(k.split(".")[1]) for k in state)
    L = sum(1 for k in state if k.startswith("heads.0.") and k.endswith("linear.weight"))
    D, V = state["heads.0.%d.weight" % L].shape[1], state["heads.0.%d.weight" % L].shape[0]
    return {"K": K, "L": L, "D": D, "V": V}


def _renamer(spec: Spec, L: int) -> Callable[[str], str]:
    """heads.{k}.{j}.linear.{weight,bias} (ResBlock j) and heads.{k}.{L}.weight (the head's lm_head) -> engine."""
    def rename(name: str) -> str:
        _, k, j, *rest = name.split(".")
        return spec.name(k, j, rest, L)
    return rename


class MedusaAdapter:
    kinds = ("medusa",)
    needs_training = True
    refused = {("sglang", "medusa"): _NO_SGLANG.format("Medusa"),
               ("speculators", "medusa"): _NO_SPECULATORS.format("medusa")}

    def supports(self, engine: str, kind: str) -> bool:
        return engine in SPECS

    def write(self, out: Path, drafter, engine: str, config: dict, output_dir: Path) -> None:
        spec = SPECS[engine]
        dtype = target_dtype(config)
        state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()
                 if k.startswith("heads.")}
        sizes = _sizes(state)
        spec.limits(sizes)
        rename = _renamer(spec, sizes["L"])
        spec.save({rename(k): v for k, v in state.items()}, out / spec.weights)
        engine_config = {key: sizes[value] if _is_size(value) else value for key, value in spec.config.items()}
        base_model = self.base_model(drafter, config, out, output_dir)
        if spec.base_model_key:
            engine_config[spec.base_model_key] = base_model
        (out / "config.json").write_text(json.dumps(engine_config, indent=2))

    def base_model(self, drafter, config: dict, out: Path, output_dir: Path) -> str:
        """What the heads are served on (the config key of a loader that reads it): the target."""
        return serve_name(config)

    def sidecar(self, drafter) -> dict[str, Any]:
        return {}

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        return self._check_heads(path, SPECS[engine], config, target)

    def _check_heads(self, path: Path, spec: Spec, config: dict, target: dict) -> list[str]:
        weights = path / spec.weights
        if not weights.is_file():
            return [f"{weights} is missing ({spec.loader} opens it)"]
        sizes = {sym: config.get(key) for key, sym in spec.config.items() if _is_size(sym)}
        problems = [f"config.json {key}={config.get(key)!r}, expected {want!r}" for key, want in spec.config.items()
                    if not _is_size(want) and config.get(key) != want]
        problems += [f"config.json lacks {key}" for key, sym in spec.config.items()
                     if _is_size(sym) and sizes[sym] is None]
        if target and sizes.get("V") not in (None, target.get("vocab_size")):
            problems.append(f"vocab_size={sizes['V']} differs from the target's {target.get('vocab_size')}")
        if problems:
            return problems
        return _check_tensors(read_weights(weights), spec, sizes)

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims):
        spec = SPECS[engine]
        config = json.loads((path / "config.json").read_text())
        K, L = config[_key(spec, "K")], config[_key(spec, "L")]
        drafter = MedusaHeads(dims, num_heads=K, num_layers=L, tree=sidecar["drafter"].get("tree"))
        rename = _renamer(spec, L)
        state = read_weights(path / spec.weights)
        drafter.load_state_dict({k: state[rename(k)] for k in drafter.state_dict()}, strict=True)
        return drafter

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return SPECS[engine].serve(target, export_dir, num_tokens)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        line = self.serve_command(engine, kind, serve_target, str(output_dir), drafter.get("num_heads", 4))
        return model_card(engine, kind, config, report, line, SPECS[engine].note(drafter))


class Medusa2Adapter(MedusaAdapter):
    """Medusa-2: the heads exactly as Medusa's, plus ``merged_target/`` (the target with the LoRA merged in: what the
    heads are served on) and ``adapter/`` (the LoRA alone)."""

    kinds = ("medusa2",)
    refused = {("sglang", "medusa2"): _NO_SGLANG.format("Medusa-2"),
               ("speculators", "medusa2"): _NO_SPECULATORS.format("medusa2")}

    def base_model(self, drafter, config: dict, out: Path, output_dir: Path) -> str:
        # medusa2's state also holds its LoRA (lora.*): it goes into merged_target/ and adapter/, not the heads file
        _write_merged_target(drafter, config, out)
        return str(output_dir.resolve() / MERGED)

    def sidecar(self, drafter) -> dict[str, Any]:
        return {"merged_target": MERGED, "adapter": ADAPTER_DIR, "verifies_against": drafter.verifies_against}

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        return super().check(path, engine, kind, config, target) + _check_merged(path, target)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        return _medusa2_card(engine, config, output_dir, report, serve_target)


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


def _check_merged(path: Path, target: dict | None) -> list[str]:
    """Medusa-2: a loadable merged target and a complete PEFT adapter directory."""
    problems = []
    merged = path / MERGED
    if not (merged / "config.json").is_file():
        problems.append(f"{merged / 'config.json'} is missing (the merged target to serve)")
    else:
        config = json.loads((merged / "config.json").read_text())
        problems += [f"{MERGED}/: {p}" for p in check_hf_model(merged, config, target or {})]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / ADAPTER_DIR / name).is_file():
            problems.append(f"{path / ADAPTER_DIR / name} is missing (the LoRA in PEFT's format)")
    return problems


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
    problem = logits_mismatch(got, adapted)
    if problem:
        raise RuntimeError(f"{MERGED}/ does not reproduce the adapted target it was merged from: {problem}")


def logits_mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` matches ``want`` up to the rounding merging causes: 1e-4 (relative to the largest logit) in
    float32; 2e-2 in 16-bit dtypes, where W + B·A is rounded once more than W x + B(A x)."""
    diff = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    tol = 1e-4 if want.dtype == torch.float32 else 2e-2
    return None if diff <= tol * scale else f"max |logit difference| {diff:.3g} > {tol:g} x {scale:.3g}"


def _medusa2_card(engine: str, config: dict, output_dir: Path, report: dict | None, serve_target: str) -> str:
    """The Medusa card, serving the merged target in place of the original, plus what Medusa-2 changes."""
    row = next((r for r in (report or {}).get("results", []) if r.get("drafter") == "medusa2"), None)
    as_medusa = {**report, "results": [{**row, "drafter": "medusa"}]} if row else None  # the card finds rows by kind
    drafter = {k: v for k, v in config.get("drafter", {}).items() if k != "lora_modules"}  # hundreds of paths on an 8B
    num_tokens = drafter.get("num_heads", 4)
    original, merged = serve_target, str(output_dir / MERGED)
    card = model_card(engine, "medusa", {**config, "drafter": drafter}, as_medusa,
                      SPECS[engine].serve(merged, str(output_dir), num_tokens), SPECS[engine].note(drafter))
    card = card.replace("# medusa drafter", "# medusa2 drafter").replace(", medusa, specdraft", ", medusa2, specdraft")
    lora = drafter.get("lora", {})
    final = (config.get("training") or {}).get("final") or {}
    losses = (f" Held-out next-token loss: original {final['heldout/original_loss']:.4f}, adapted "
              f"{final['heldout/adapted_loss']:.4f}." if "heldout/original_loss" in final else "")
    return card + (
        f"\n## Medusa-2: serve the merged target, not the original\n"
        f"The heads were trained jointly with a LoRA (r={lora.get('r')}, alpha={lora.get('alpha')}) on the target, and "
        f"they read the ADAPTED target's hidden states: `{MERGED}/` is `{original}` with that LoRA merged into its "
        f"weights (a plain Hugging Face directory with the target's tokenizer). Serve it as the model (specdraft's "
        f"evaluation verifies against it too): served output is the merged target's, and on the original target the "
        f"heads would read states they were not trained on. `{ADAPTER_DIR}/` holds the LoRA alone "
        f"(`PeftModel.from_pretrained(base, '{ADAPTER_DIR}')`).{losses}\n")
