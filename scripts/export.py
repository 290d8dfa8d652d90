"""Export a trained drafter for serving.

    python scripts/export.py drafter_path=runs/<date>/<time>/drafter format=vllm output_dir=exports/medusa-vllm
    python scripts/export.py drafter_path=... format=vllm|sglang|speculators|hf output_dir=... [overwrite=true]

Hydra overrides of ``ExportConfig`` (``--overwrite`` is still read as ``overwrite=true``).

Formats: vllm (EAGLE-1/3 as vLLM's Eagle(3)LlamaForCausalLM; Medusa as MedusaModel; draft models as a plain HF
directory), sglang (EAGLE-1/3 as LlamaForCausalLMEagle(3); draft models served with --speculative-algorithm
STANDALONE; SGLang has no Medusa), speculators (EAGLE-3 in the vllm-project/speculators format vLLM auto-detects),
hf (EAGLE-1 in SafeAILab/EAGLE's layout; Medusa in FasterDecoding/Medusa's; draft models as a plain HF directory).
The export is checked against the engine's conformance spec (``serve/export.py``, ``serve/eagle.py``) before
it is swapped into place, and carries a README.md model card with the serving command.
If the drafter's run dir holds a report.json (``python -m train`` writes one), its measured τ, α and speedup go into
the model card.
"""

import difflib
import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from hydra import compose, initialize
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import MISSING, OmegaConf

from distill.environment import explain
from serve.export import export_drafter

USAGE = ("python scripts/export.py drafter_path=<dir> format=vllm|sglang|speculators|hf output_dir=<dir> "
         "[overwrite=true]")


# Annotations stay evaluated here (no ``from __future__ import annotations``): tests load this file by path, outside
# sys.modules, where dataclasses cannot resolve string annotations.
@dataclass
class ExportConfig:
    drafter_path: str = MISSING  # a trained drafter: <run dir>/drafter
    format: str = MISSING  # vllm | sglang | speculators | hf
    output_dir: str = MISSING  # written atomically; an existing one only with overwrite=true
    overwrite: bool = False  # replace output_dir (never the run dir or anything inside it)


def check_tokens(argv: list[str]) -> None:
    """One line for an argument Hydra's override grammar cannot read, naming it and the fix, before Hydra answers
    with its parser's traceback: a flag other than ``--overwrite`` (``--overwite``), or a word without ``=`` (a path
    with a space the shell split in two)."""
    keys = [f.name for f in fields(ExportConfig)]
    for number, token in enumerate(argv):
        if token.startswith("-") and token != "--overwrite":
            close = difflib.get_close_matches(token, ["--overwrite", *(f"--{k}" for k in keys)], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SystemExit(f"error: unknown flag {token!r}{hint}; arguments are key=value (or --overwrite); "
                             f"usage: {USAGE}")
        if "=" not in token and not token.startswith("-"):
            before = f" after {argv[number - 1]!r}" if number else ""
            raise SystemExit(f"error: argument {token!r}{before} is not key=value; a value holding a space must be "
                             f"quoted as one argument, e.g. 'output_dir=/path/with space'; usage: {USAGE}")


def parse(argv: list[str]) -> ExportConfig:
    """The command line as Hydra overrides of ``ExportConfig``: an unknown key or a missing one is an error."""
    check_tokens(argv)
    overrides = ["overwrite=true" if token == "--overwrite" else token for token in argv]
    ConfigStore.instance().store(name="export", node=ExportConfig)
    try:
        with initialize(version_base="1.3", config_path=None):
            cfg = compose(config_name="export", overrides=overrides)
    except (ConfigCompositionException, OverrideParseException) as e:
        detail = " ".join(str(e.__cause__ or e).split())  # one line: Hydra's messages span several
        raise SystemExit(f"unknown argument in {' '.join(argv)!r} ({detail}); usage: {USAGE}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}; usage: {USAGE}")
    args = OmegaConf.to_object(cfg)
    args.drafter_path, args.output_dir = (os.path.expanduser(str(v)) for v in (args.drafter_path, args.output_dir))
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse(sys.argv[1:] if argv is None else argv)
    report_file = Path(args.drafter_path).parent / "report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else None
    out = export_drafter(args.drafter_path, args.format, args.output_dir, overwrite=args.overwrite, report=report)
    print(f"exported {args.drafter_path} as {args.format} to {out}; see {out / 'README.md'} for the serve command")
    return out


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:  # a full disk, a path in the way, no permission; and the refusals' own messages
        raise SystemExit(f"error: {explain(e)}") from None
