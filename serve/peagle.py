"""P-EAGLE's export adapter: vLLM serves it as EAGLE-3 with parallel drafting, so the export is EAGLE-3's vLLM layout
(``serve.eagle``: the same tensors, names, layer ids and draft vocabulary maps) plus what parallel drafting reads:

    config.json  architectures ["PeagleLlamaForCausalLM"]   vLLM's model registry maps it to Eagle3LlamaForCausalLM
                 pard_token = our mask_token_id               the id its proposer feeds the parallel slots (it reads
                                                              ``pard_token`` or ``ptd_token_id``; newer releases also
                                                              a top-level ``mask_token_id``, written with the same id)
    weights      mask_hidden [1, F*D]                         the placeholder for the target features of the parallel
                                                              slots (pre-fc), loaded beside the EAGLE-3 parameters

Read from vLLM's ``vllm/model_executor/models/registry.py`` (the Peagle* aliases),
``vllm/transformers_utils/configs/speculators/algos.py`` (``update_peagle``: the config keys it sets, ``pard_token``
from ``mask_token_id``), ``vllm/v1/spec_decode/llm_base_proposer.py`` (the parallel-drafting token id) and its tests'
``mask_hidden`` fixture ([1, 3 x hidden]). The serve command names ``method: eagle3`` and ``parallel_drafting: true``
explicitly (vLLM does not infer a P-EAGLE method from a plain checkpoint).

SGLang, the speculators format and Hugging Face are refused: their P-EAGLE loaders are not transcribed here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from heads.base import TargetDims
from heads.peagle import PEagleDrafter
from serve.adapter import serve_name, target_dtype, target_facts, vocab_problem
from serve.eagle import (check_target_family, drafter_from_engine, engine_config, engine_state, load_like_engine,
                         our_layers, written_layer_ids)
from serve.model_card import model_card

ARCHITECTURE = "PeagleLlamaForCausalLM"
MASK_HIDDEN = "mask_hidden"


def _vllm_serve(target: str, export_dir: str, num_tokens: int) -> str:
    spec = {"method": "eagle3", "model": export_dir, "num_speculative_tokens": num_tokens, "parallel_drafting": True}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


class PEagleAdapter:
    kinds = ("peagle",)
    needs_training = True
    refused = {("sglang", "peagle"): "SGLang's P-EAGLE (parallel drafting) loader is not transcribed in specdraft; "
                                     "export with format=vllm (vLLM: method eagle3 with parallel_drafting)",
               ("speculators", "peagle"): "specdraft writes P-EAGLE in vLLM's EAGLE-3 layout only; export with "
                                          "format=vllm",
               ("hf", "peagle"): "P-EAGLE has no Hugging Face reference model class; export with format=vllm"}

    def supports(self, engine: str, kind: str) -> bool:
        return engine == "vllm"

    def write(self, out: Path, drafter: PEagleDrafter, engine: str, config: dict, output_dir: Path) -> None:
        facts = target_facts(config)
        check_target_family(engine, "eagle3", facts.get("model_type"))
        dtype = target_dtype(config)
        target = {**config.get("target", {}), **facts, "serve_name": serve_name(config)}
        cfg = engine_config(drafter, engine, target, str(dtype).removeprefix("torch."), drafter.num_depths)
        cfg.update(architectures=[ARCHITECTURE], pard_token=drafter.mask_token_id,
                   mask_token_id=drafter.mask_token_id)
        state = engine_state(drafter, engine, dtype)
        state[MASK_HIDDEN] = drafter.mask_hidden.detach().to(dtype)[None].contiguous()
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))

    def sidecar(self, drafter) -> dict[str, Any]:
        return {}

    def _engine_state(self, path: Path, config: dict) -> tuple[dict, torch.Tensor | None, torch.Tensor | None,
                                                                 list[str]]:
        """(EAGLE-3 parameters as vLLM loads them, d2t's target ids, mask_hidden, problems)."""
        state = load_file(str(path / "model.safetensors"))
        mask_hidden = state.pop(MASK_HIDDEN, None)
        params, vocab, problems = load_like_engine("vllm", "eagle3", state, config)
        width = config["hidden_size"] * 3
        if mask_hidden is None:
            problems.append(f"tensor {MASK_HIDDEN!r} is missing: vLLM's parallel drafting requires it")
        elif mask_hidden.numel() != width or mask_hidden.shape[-1] != width:
            problems.append(f"{MASK_HIDDEN} has shape {tuple(mask_hidden.shape)}; vLLM reads [1, {width}] (3 x hidden)")
        return params, vocab, mask_hidden, problems

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        if not (path / "model.safetensors").is_file():
            return [f"{path / 'model.safetensors'} is missing"]
        need = ("architectures", "hidden_size", "vocab_size", "draft_vocab_size", "pard_token")
        problems = [f"config.json lacks {key}" for key in need if key not in config]
        if problems:
            return problems
        if config["architectures"] != [ARCHITECTURE]:
            problems.append(f"config.json architectures={config['architectures']!r}, expected [{ARCHITECTURE!r}]")
        token = config["pard_token"]
        if not isinstance(token, int) or not 0 <= token < config["vocab_size"]:
            problems.append(f"pard_token={token!r} is not a token id of the vocabulary")
        elif config.get("mask_token_id", token) != token:
            problems.append(f"mask_token_id={config['mask_token_id']!r} differs from pard_token={token}")
        ids = written_layer_ids(engine, config)
        if not ids or len(ids) != 3:
            problems.append(f"eagle_aux_hidden_state_layer_ids={ids!r}: vLLM needs the 3 target layers")
        if "norm_before_residual" not in config:
            problems.append("config.json lacks norm_before_residual (the residual convention must be explicit)")
        problems += vocab_problem(config["vocab_size"], target)
        _, vocab, _, mapped = self._engine_state(path, config)
        problems += mapped
        if vocab is not None and not (vocab.min() >= 0 and vocab.max() < config["vocab_size"]
                                      and vocab.unique().numel() == vocab.numel()):
            problems.append("d2t offsets do not map the draft vocabulary onto distinct target ids")
        return problems

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims) -> PEagleDrafter:
        """The drafter rebuilt from what vLLM reads: EAGLE-3's parameters (``serve.eagle.drafter_from_engine``), the
        mask token and ``mask_hidden``; the training-only depth sampling keys come from the sidecar."""
        config = json.loads((path / "config.json").read_text())
        params, vocab, mask_hidden, problems = self._engine_state(path, config)
        if problems:
            raise ValueError(f"{path} does not load into vLLM's P-EAGLE: " + "; ".join(problems))
        layers = our_layers(engine, "eagle3", config)
        eagle3 = drafter_from_engine(engine, "eagle3", params, vocab, config, dims, layers, {})
        saved = sidecar["drafter"]
        drafter = PEagleDrafter(dims, layers=layers, num_heads=config["num_attention_heads"],
                                intermediate_size=config["intermediate_size"], rope_theta=config["rope_theta"],
                                draft_vocab_size=config["draft_vocab_size"], mask_token_id=config["pard_token"],
                                num_depths=saved.get("num_depths", 8), depth=saved.get("depth"))
        state = {**eagle3.state_dict(), MASK_HIDDEN: mask_hidden.reshape(-1).to(torch.float32)}
        drafter.load_state_dict(state, strict=True)
        return drafter

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return _vllm_serve(target, export_dir, num_tokens)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        tokens = drafter.get("depth") or drafter.get("num_depths") or 8
        line = self.serve_command(engine, kind, serve_target, str(output_dir), tokens)
        notes = [f"P-EAGLE: EAGLE-3's layout plus `mask_hidden` and `pard_token` (the parallel slots' inputs); vLLM "
                 f"drafts {tokens} tokens per forward with parallel drafting. Target layers (specdraft hidden-state "
                 f"indices): {drafter.get('layers')}. The target's embeddings are not in this export: the engine "
                 f"shares the target's own.", ""]
        return model_card(engine, kind, config, report, line, notes)
