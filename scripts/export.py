"""Export a trained drafter for serving.

    python scripts/export.py drafter_path=runs/<date>/<time>/drafter format=vllm output_dir=exports/medusa-vllm
    python scripts/export.py drafter_path=... format=vllm|sglang|speculators|hf output_dir=... [--overwrite]

Formats: vllm (EAGLE-1/3 as vLLM's Eagle(3)LlamaForCausalLM; Medusa as MedusaModel; draft models as a plain HF
directory), sglang (EAGLE-1/3 as LlamaForCausalLMEagle(3); draft models served with --speculative-algorithm
STANDALONE; SGLang has no Medusa), speculators (EAGLE-3 in the vllm-project/speculators format vLLM auto-detects),
hf (EAGLE-1 in SafeAILab/EAGLE's layout; Medusa in FasterDecoding/Medusa's; draft models as a plain HF directory).
The export is checked against the engine's conformance spec (``heads/export.py``, ``heads/export_eagle.py``) before
it is swapped into place, and carries a README.md model card with the serving command.
If the drafter's run dir holds a report.json (``python -m train`` writes one), its measured τ, α and speedup go into
the model card.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEYS = ("drafter_path", "format", "output_dir")


def parse(argv: list[str]) -> tuple[dict[str, str], bool]:
    args, overwrite = {}, False
    for token in argv:
        if token in ("--overwrite", "overwrite=true"):
            overwrite = True
        elif "=" in token and token.split("=", 1)[0] in KEYS:
            key, value = token.split("=", 1)
            args[key] = value
        else:
            raise SystemExit(f"unknown argument {token!r}; usage: {__doc__.strip().splitlines()[0]}\n"
                             f"valid keys: {', '.join(KEYS)} and --overwrite")
    missing = [k for k in KEYS if k not in args]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}; usage: python scripts/export.py drafter_path=<dir> "
                         f"format=vllm|sglang|speculators|hf output_dir=<dir> [--overwrite]")
    return args, overwrite


def main(argv: list[str] | None = None) -> Path:
    from heads.export import export_drafter

    args, overwrite = parse(sys.argv[1:] if argv is None else argv)
    report_file = Path(args["drafter_path"]).parent / "report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else None
    out = export_drafter(args["drafter_path"], args["format"], args["output_dir"], overwrite=overwrite, report=report)
    print(f"exported {args['drafter_path']} as {args['format']} to {out}; see {out / 'README.md'} for the serve command")
    return out


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise SystemExit(f"error: {e}") from None
