#!/usr/bin/env bash
# The GPU training measurement as one command (docs/benchmarks.md, "Training speed"), for a machine lent for
# minutes: every phase writes its JSON and log under $OUT before the next starts, each is cut at the deadline, and
# the JSON is rewritten after every (kind, mode) run, so a cut phase keeps what it finished.
#
#   OUT=<dir> DEADLINE_S=560 bash scripts/bench_train_gpu.sh
#   PRESET=tiny COMPILE_BACKEND=aot_eager OUT=/tmp/bench bash scripts/bench_train_gpu.sh   # end to end on a CPU
#
# A randomly initialised target at Llama-3.1-8B's shape (vocabulary 128,256, bf16, sequence 2048; no download),
# random packed rows, the real training loop (scripts/bench_train_kinds.py):
# 1. eagle3: EAGLE-3 (TTT 7, a 32k draft vocabulary), eager then compiled: tokens/s, TFLOP/s, MFU, peak memory.
# 2. dflash: DFlash compiled, then eager.
# 3. kinds: EAGLE-1, P-EAGLE, Medusa and a draft model, compiled.
# 4. fsdp: EAGLE-3 under torchrun on one rank with trainer=fsdp (NCCL), compiled, beside phase 1's single-process
#    losses (fsdp_check.json: the largest relative difference per logged step).
# What comes back is $OUT/phases.txt (versions, each phase's time, return code and last lines) and each phase's log
# and JSON. Needs torch and transformers; hydra, omegaconf and antlr4 may come from a folder on PYTHONPATH
# (.gpu_deps: copy them from a virtual environment that has them).
set -u
OUT=${OUT:-scripts/results/gpu_train}
DEADLINE_S=${DEADLINE_S:-560}
PRESET=${PRESET:-8b}
STEPS=${STEPS:-12}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPECDRAFT_CACHE=${SPECDRAFT_CACHE:-/tmp/specdraft-cache}
PY=${PYTHON:-python3}
BENCH="scripts/bench_train_kinds.py --preset $PRESET --steps $STEPS"
# aot_eager: compiled runs traced without code generation (a quick CPU check of the script; inductor otherwise)
[[ -n "${COMPILE_BACKEND:-}" ]] && BENCH="$BENCH --compile-backend $COMPILE_BACKEND"
source "$(dirname "$0")/gpu_phases.sh"  # phase DIR NAME MAX_SECONDS COMMAND...

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null
  $PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
} > "$OUT/phases.txt" 2>&1
cat "$OUT/phases.txt"

phase "$OUT" eagle3 240 $PY $BENCH --kinds eagle3 --modes eager,compiled --out "$OUT/train_eagle3.json"
phase "$OUT" dflash 150 $PY $BENCH --kinds dflash --modes compiled,eager --out "$OUT/train_dflash.json"
phase "$OUT" kinds 200 $PY $BENCH --kinds eagle1,peagle,medusa,draft_model --modes compiled --out "$OUT/train_kinds.json"
phase "$OUT" fsdp 120 $PY -m torch.distributed.run --standalone --nproc_per_node 1 $BENCH --kinds eagle3 --modes compiled \
  --engine fsdp --out "$OUT/train_fsdp.json"
$PY - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/phases.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    single = json.loads((out / "train_eagle3.json").read_text())["runs"]["eagle3"]["compiled"]["losses"]
    fsdp = json.loads((out / "train_fsdp.json").read_text())["runs"]["eagle3"]["compiled"]["losses"]
except (OSError, KeyError) as e:
    print(f"fsdp check: not available ({type(e).__name__}: {e})")
    raise SystemExit(0)
diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(single, fsdp)]
check = {"single_losses": single, "fsdp_losses": fsdp, "max_rel_diff": max(diffs) if diffs else None}
(out / "fsdp_check.json").write_text(json.dumps(check, indent=1))
print(f"fsdp check: {len(diffs)} logged steps, largest relative loss difference {check['max_rel_diff']}")
EOF
echo "done after $(( $(date +%s) - start ))s"
