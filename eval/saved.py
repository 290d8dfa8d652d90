"""Re-evaluating a saved drafter (``python -m eval drafter_path=<dir>``): which settings come from the drafter's own
run, which from the command line, and how the rest fits the target.

- drafter: the saved config.json defines it. ``drafter=<preset>`` is refused (the kind comes from the weights);
  ``drafter.<key>=`` applies when it only steers decoding (``Drafter.decode_keys``: tree, top_k, depth,
  total_tokens) and is refused with the reason otherwise (``heads.saved.decode_overrides``).
- target: the saved ``target_config`` unless ``target=<preset>`` names another; ``target.<key>=`` overrides apply on
  top of it. ``trust_remote_code`` comes from the command line only, never from a file.
- eval: ``eval.<key>=`` on the command line wins; otherwise the run's own evaluation settings (saved with the
  drafter) are reused; what is still too long for the target's context is shortened to fit, and said so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

# Evaluation settings a run's own evaluation used, reused when the command line does not set them.
RUN_EVAL_KEYS = ("prompts", "num_prompts", "prompt_tokens", "max_new_tokens", "num_draft")


@dataclass
class CommandLine:
    """The user's Hydra overrides, split: config groups chosen (``target=tiny``) and dotted keys set (``eval.x=1``)."""

    groups: dict[str, str] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)

    def under(self, prefix: str) -> list[str]:
        """Keys set below ``prefix`` (``drafter.top_k`` for ``drafter``), without the prefix."""
        return [k[len(prefix) + 1:] for k in self.keys if k.startswith(prefix + ".")]


def parse_overrides(overrides: Sequence[str]) -> CommandLine:
    """Hydra's own reading of the command line's overrides (``HydraConfig.get().overrides.task``), sorted into groups
    chosen and keys set."""
    cli = CommandLine()
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if "." in key:
            cli.keys.add(key)
        else:
            cli.groups[key] = override.get_value_element_as_str()
    return cli


def drafter_overrides(cfg, cli: CommandLine, saved: Mapping, path) -> dict:
    """The ``drafter.<key>`` values the user gave, by top-level key; ``drafter=<preset>`` is refused."""
    if "drafter" in cli.groups:
        raise ValueError(f"drafter={cli.groups['drafter']} builds a new drafter, but drafter_path={path} loads a trained "
                         f"{saved['drafter'].get('_target_')} (its kind and sizes come from its config.json and "
                         f"weights); drop drafter=..., or evaluate an untrained drafter without drafter_path")
    out = {}
    for key in cli.under("drafter"):
        top = key.split(".")[0]
        value = OmegaConf.select(cfg, f"drafter.{top}")
        out[top] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def target_config(cfg, cli: CommandLine, saved: Mapping) -> dict:
    """The target to evaluate against: the saved one (with the user's ``target.<key>`` overrides), or the preset the
    user named with ``target=``. Remote code only when the command line asks for it."""
    if "target" in cli.groups:
        return OmegaConf.to_container(cfg.target, resolve=True)
    node = OmegaConf.create(dict(saved["target_config"]))
    for key in cli.under("target"):
        OmegaConf.update(node, key, OmegaConf.select(cfg, f"target.{key}"), force_add=True)
    out = OmegaConf.to_container(node, resolve=True)
    out["trust_remote_code"] = "trust_remote_code" in cli.under("target") and bool(cfg.target.trust_remote_code)
    return out


def eval_settings(eval_cfg: Mapping, saved: Mapping, cli: CommandLine, max_positions: int) -> dict:
    """``eval`` for a saved drafter: command line > the run's own evaluation settings > defaults, then fitted to the
    target's context (``fit_to_context``)."""
    given = set(cli.under("eval"))
    out = dict(eval_cfg)
    run = ((saved.get("training") or {}).get("eval")) or {}
    reused = {k: run[k] for k in RUN_EVAL_KEYS if k in run and k not in given and run[k] != out.get(k)}
    if reused:
        log.info("eval: the run's own settings %s (saved with the drafter); set eval.<key>=... to change them",
                 ", ".join(f"{k}={v}" for k, v in reused.items()))
        out.update(reused)
    return fit_to_context(out, max_positions, given)


def fit_to_context(eval_cfg: Mapping, max_positions: int, given: set[str] = frozenset()) -> dict:
    """Shorten ``prompt_tokens`` / ``max_new_tokens`` (those the user did not set) so prompt + new tokens + draft
    lookahead fit ``max_positions``, keeping their ratio. Settings the user gave are left as given: the decoder then
    says what to lower."""
    out = dict(eval_cfg)
    prompt, new, lookahead = out["prompt_tokens"], out["max_new_tokens"], out["num_draft"]
    budget = max_positions - lookahead
    if not max_positions or prompt + new <= budget or budget < 2:
        return out
    if "prompt_tokens" in given and "max_new_tokens" in given:
        return out
    if "prompt_tokens" in given:
        new = budget - prompt
    elif "max_new_tokens" in given:
        prompt = budget - new
    else:
        prompt = max(1, budget * prompt // (prompt + new))
        new = budget - prompt
    if prompt < 1 or new < 1:
        return out
    log.warning("eval: prompt_tokens=%d + max_new_tokens=%d + num_draft=%d exceed the target's %d positions; using "
                "prompt_tokens=%d, max_new_tokens=%d (set them on the command line to choose)", out["prompt_tokens"],
                out["max_new_tokens"], lookahead, max_positions, prompt, new)
    out.update(prompt_tokens=prompt, max_new_tokens=new)
    return out
