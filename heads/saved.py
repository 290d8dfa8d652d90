"""A trained drafter on disk: ``save_drafter`` / ``load_drafter`` write and read a directory of ``model.safetensors``
+ ``config.json`` (the drafter's Hydra node, the target dims it was built for, the target identity and its weights
digest), refusing non-specdraft directories, missing or unexpected tensors, non-finite weights (at save and at
load, so neither evaluation nor export takes them), weights whose bytes differ from the sha256 written beside them
(``model.safetensors.sha256``), remote code unless asked for, and a target whose weights differ from the one the
drafter was trained against.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file
from torch import Tensor

from distill.atomic import clear_unfinished, save_tensors, write_dir_atomically
from distill.fingerprint import check_digest, file_digest, write_digest
from heads.base import Drafter, TargetDims, instantiate_drafter

FORMAT = "specdraft-drafter"
FORMAT_VERSION = 1
WEIGHTS, CONFIG = "model.safetensors", "config.json"
# Drafter classes saved under a module path that has since moved: a directory saved before still loads.
MOVED_TARGETS = {"heads.medusa2.Medusa2": "heads.medusa.Medusa2"}

log = logging.getLogger(__name__)


# --- save / load -------------------------------------------------------------------------------------------


def save_drafter(drafter: Drafter, path: str | os.PathLike, drafter_cfg: Mapping[str, Any], target_cfg: Mapping[str, Any],
                 target_identity: Mapping[str, Any], extra: Mapping[str, Any] | None = None,
                 state_dict: Mapping[str, Tensor] | None = None) -> Path:
    """``state_dict``: the drafter's full weights when ``drafter`` itself holds only a shard (FSDP / ZeRO-3). A
    drafter directory has one writer (the run dir's lock holder), so what a killed save of it left beside it (a
    hidden copy of the weights) is cleared first."""
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "drafter": drafter.saved_config(drafter_cfg),
        "dims": asdict(drafter.dims),
        "target": dict(target_identity),
        "target_config": dict(target_cfg),
        **(dict(extra) if extra else {}),
    }
    weights = drafter.state_dict() if state_dict is None else state_dict
    tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise FloatingPointError(f"refusing to save {path}: {len(bad)} weight tensor(s) hold NaN or inf (first: "
                                 f"{bad[0]}); training diverged: lower trainer.lr and train into a fresh hydra.run.dir")

    def write(tmp: Path) -> None:
        if tensors:
            save_tensors(tensors, tmp / WEIGHTS, metadata={"format": FORMAT})
            write_digest(tmp / WEIGHTS)  # checked on every load (load_saved_drafter)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, default=str))

    clear_unfinished(path)
    return write_dir_atomically(path, write)


def weights_digest(path: str | os.PathLike) -> str | None:
    """The sha256 of a saved drafter's weights file (None where there is none): what a report records for each drafter
    it measured, so a report is only ever shown for the weights it measured (``serve.export``)."""
    weights = Path(path) / WEIGHTS
    return file_digest(weights) if weights.is_file() else None


def read_drafter_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"drafter_path={str(path)!r} has no {CONFIG}; point drafter_path at a directory written by "
            f"`python -m train` (<run dir>/drafter)"
        )
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is damaged ({e}); copy the drafter directory again, or use another checkpoint "
                         f"(checkpoints/step_*/drafter)") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{cfg_file} is not a specdraft drafter config (format={found!r})")
    node = config.get("drafter")
    if isinstance(node, dict) and node.get("_target_") in MOVED_TARGETS:
        node["_target_"] = MOVED_TARGETS[node["_target_"]]
    return _no_remote_code(config, cfg_file)


def _no_remote_code(config: dict, cfg_file: Path) -> dict:
    """Remote code is enabled by the user's own command line, never by a file: a saved ``trust_remote_code: true``
    (for the target, or a draft model's own weights) is read back as false, with a warning saying how to enable it."""
    for key, node in (("target", config.get("target_config")), ("drafter", config.get("drafter"))):
        if isinstance(node, dict) and node.get("trust_remote_code"):
            log.warning("%s asks for %s.trust_remote_code=true; ignored: a saved file never enables remote code. "
                        "Pass %s.trust_remote_code=true on the command line if you trust that code", cfg_file, key, key)
        if isinstance(node, dict) and "trust_remote_code" in node:
            node["trust_remote_code"] = False
    return config


def decode_overrides(drafter_cfg: Mapping[str, Any], overrides: Mapping[str, Any], source: str) -> dict:
    """``drafter_cfg`` (a saved drafter's node) with the user's ``drafter.<key>`` overrides applied. Only keys that
    change how the trained weights are used, not the weights, apply: the class's ``decode_keys`` it takes, and
    ``trust_remote_code`` (remote code comes from the command line only). Any other key is refused with the reason:
    it would change (or would have changed) the weights, so only retraining can honour it."""
    import inspect

    from hydra.utils import get_class

    cls = get_class(drafter_cfg["_target_"])
    params = inspect.signature(cls.__init__).parameters
    allowed = {k for k in cls.decode_keys if k in params} | ({"trust_remote_code"} & set(params))
    out = dict(drafter_cfg)
    for key, value in overrides.items():
        if key not in params:
            raise ValueError(f"drafter.{key} is not a setting of the saved drafter ({drafter_cfg['_target_']} at "
                             f"{source}); settings that apply when decoding it: {sorted(allowed) or 'none'}")
        if key not in allowed:
            raise ValueError(f"drafter.{key}={value!r} cannot apply to the saved drafter at {source} (trained with "
                             f"drafter.{key}={drafter_cfg.get(key)!r}): it fixes how the weights were built or trained, "
                             f"so only retraining with it can honour it. Decode-time settings you can change: "
                             f"{sorted(allowed) or 'none'}")
        out[key] = value
    return out


def load_saved_drafter(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> tuple[Drafter, dict]:
    """(drafter with its trained weights, its config.json), rebuilt for the dims it was saved with — no target
    needed (exporting must not load an 8B model). Missing or unexpected tensors are an error, never skipped.
    ``overrides``: decode-time ``drafter.<key>`` values from the command line (``decode_overrides``)."""
    path = Path(path)
    config = read_drafter_config(path)
    if overrides:
        config["drafter"] = decode_overrides(config["drafter"], overrides, str(path))
    drafter = instantiate_drafter(config["drafter"], TargetDims(**config["dims"]))
    expected = drafter.state_dict()
    if expected:
        weights = path / WEIGHTS
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} is missing; the drafter directory {path} is incomplete")
        try:
            state = load_file(str(weights))
        except Exception as e:  # safetensors raises its own error types for truncated or foreign files
            raise ValueError(f"{weights} is not a readable safetensors file ({type(e).__name__}: {e}); the drafter "
                             f"directory is damaged: copy it again, or use another checkpoint "
                             f"(checkpoints/step_*/drafter)") from None
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{weights} does not match {config['drafter'].get('_target_')}: missing {missing}, unexpected {unexpected}")
        check_digest(weights)
        nonfinite = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if nonfinite:
            raise ValueError(f"{weights} holds NaN or inf in {len(nonfinite)} tensor(s) (first: {nonfinite[0]}); "
                             f"a drafter with non-finite weights is never evaluated or exported: use another "
                             f"checkpoint (checkpoints/step_*/drafter) or retrain with a lower trainer.lr")
        drafter.load_state_dict(state, strict=True)
    return drafter.eval(), config


def check_target_weights(path: Path, config: Mapping, teacher, allow_other_target: bool = False) -> None:
    """Refuse a target whose weights differ from those the drafter was trained against (same name and sizes, e.g. a
    toy target built with another seed): its τ would be measured against the wrong model. Drafters saved before the
    digest was stored are not checked."""
    saved = (config.get("target") or {}).get("weights_digest")
    if not saved:
        return
    actual = teacher.weights_digest()
    if saved == actual:
        return
    message = (f"drafter at {path} was trained against target weights with digest {saved}, but the target "
               f"{teacher.name!r} has {actual} (same name and sizes, other weights)")
    if allow_other_target:
        log.warning("%s; measuring anyway (eval.allow_other_target=true)", message)
        return
    raise ValueError(f"{message}; evaluate it against the target it was trained for (target_config in "
                     f"{path / CONFIG}), or pass eval.allow_other_target=true to measure it against this one anyway")


def load_drafter(path: str | os.PathLike, teacher, overrides: Mapping[str, Any] | None = None,
                 allow_other_target: bool = False) -> Drafter:
    """Rebuild a saved drafter for ``teacher``; refuse a checkpoint made for a target of other sizes or, unless
    ``allow_other_target``, other weights. ``overrides``: decode-time settings (``decode_overrides``)."""
    path = Path(path)
    config = read_drafter_config(path)
    saved = TargetDims(**config["dims"])
    actual = TargetDims(teacher.hidden_size, teacher.vocab_size, teacher.num_layers)
    for name in ("vocab_size", "hidden_size", "num_layers"):
        if getattr(saved, name) != getattr(actual, name):
            raise ValueError(
                f"drafter at {path} was trained for a target with {name}={getattr(saved, name)}, but the target "
                f"{teacher.name!r} has {name}={getattr(actual, name)}; evaluate it against the target it was trained "
                f"for (target config saved in {path / CONFIG}) or retrain"
            )
    check_target_weights(path, config, teacher, allow_other_target)
    drafter, _ = load_saved_drafter(path, overrides)
    drafter.bind_target(teacher, initialize=False)
    return drafter.to(teacher.device).eval()
