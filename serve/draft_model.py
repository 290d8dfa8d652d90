"""A draft LM to every engine: the same plain Hugging Face model directory (vLLM and SGLang load it as a normal LM;
transformers' assisted generation takes it as ``assistant_model``). What differs per engine is the serve command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from heads.base import TargetDims
from heads.draft_model.model import DraftModel
from serve.adapter import check_hf_model
from serve.model_card import model_card


def _vllm(target: str, export_dir: str, num_tokens: int) -> str:
    spec = {"method": "draft_model", "model": export_dir, "num_speculative_tokens": num_tokens}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def _sglang(target: str, export_dir: str, num_tokens: int) -> str:
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm STANDALONE "
            f"--speculative-draft-model-path {export_dir} --speculative-num-steps {num_tokens} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {num_tokens + 1}")


def _transformers(target: str, export_dir: str, num_tokens: int) -> str:
    return (f"AutoModelForCausalLM.from_pretrained('{target}').generate(ids, "
            f"assistant_model=AutoModelForCausalLM.from_pretrained('{export_dir}'))")


# engine -> (target, export dir, draft tokens) -> the command that serves the export. One row per engine.
SERVE: dict[str, Callable[[str, str, int], str]] = {"vllm": _vllm, "sglang": _sglang, "hf": _transformers}


class DraftModelAdapter:
    kinds = ("draft_model",)
    needs_training = False  # a draft LM is usable as it comes
    refused = {("speculators", "draft_model"): "the speculators format holds EAGLE-3 drafters only (speculators 0.9.0 "
                                               "has no draft_model model class); serve draft_model with format=vllm"}

    def supports(self, engine: str, kind: str) -> bool:
        return engine in SERVE

    def write(self, out: Path, drafter, engine: str, config: dict, output_dir: Path) -> None:
        drafter.model.save_pretrained(out, safe_serialization=True)
        _copy_tokenizer(config.get("target_config", {}), out)

    def sidecar(self, drafter) -> dict[str, Any]:
        return {}

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        return check_hf_model(path, config, target)

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims):
        from transformers import AutoModelForCausalLM

        return DraftModel(dims, model=AutoModelForCausalLM.from_pretrained(path))

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return SERVE[engine](target, export_dir, num_tokens)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        line = self.serve_command(engine, kind, serve_target, str(output_dir), drafter.get("depth") or 4)
        return model_card(engine, kind, config, report, line, [])


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
