#!/usr/bin/env bash
# The GPU decoding measurement as one command (docs/gpu-decoding.md, "GPU measurement recipe"), for a machine that
# is lent for minutes: every phase writes its JSON and log under $OUT before the next starts, and each is cut at the
# deadline so the command ends inside its lease.
#
#   OUT=<dir> DEADLINE_S=560 bash scripts/bench_decode_gpu.sh
#
# 0. smoke: the step decoder's CUDA test (graphed and compiled steps token-identical to eager ones).
# 1. modes: plain and EAGLE-1 (400 steps on the stdlib text) with CUDA graphs over eager steps, HF's compiled static
#    generate, then compiled steps under graphs, the default on CUDA (scripts/bench_decode_modes.py: each bucket
#    compiles once, about 20 s): the figures the decoder's targets are read from, first.
# 2. smoke_tiny: the tiny preset with every drafter kind under the default settings (compiled, graphed): every kind's
#    steps compile on CUDA (numbers meaningless; 3 prompts, no HF baselines, no second eager-steps evaluation and
#    drafters in bf16 without timing float32 too, so it compiles only the steps a decode uses). A failure stops here.
# 3. core: the 1.14B preset (--target-steps, default 150) with decoder.compile=off: plain with CUDA graphs and
#    without, HF generate() eager and static, prompt lookup and EAGLE-1, and the cost model's overhead ratios.
# 4. parallel: the same target, the target's own greedy answers regenerated once, then EAGLE-1, DFlash and P-EAGLE
#    trained on them (400 steps each) and decoded in one run, graphed (decoder.compile=off).
# What comes back is $OUT/phases.txt (versions, each phase's time, return code and last lines) and each long phase's
# log and JSON; the smoke phases' logs stay under $RUNS.
# Needs torch, transformers and tokenizers; hydra, omegaconf and antlr4 may come from a folder on PYTHONPATH
# (.gpu_deps: copy them from a virtual environment that has them).
set -u
OUT=${OUT:-scripts/results/gpu}
DEADLINE_S=${DEADLINE_S:-560}
TARGET_STEPS=${TARGET_STEPS:-150}
PRESET=${PRESET:-gpu}  # PRESET=tiny checks the script end to end in minutes on a CPU
PROMPTS=${PROMPTS:-10}
RUNS=${RUNS:-/tmp/specdraft-gpu-runs}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPECDRAFT_CACHE=${SPECDRAFT_CACHE:-/tmp/specdraft-cache}
# Inductor's caches in one place for every phase (a test's own SPECDRAFT_CACHE included): a rerun on the same machine
# loads the compiled kernels instead of compiling them again.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$SPECDRAFT_CACHE/inductor}
PY=${PYTHON:-python3}
source "$(dirname "$0")/gpu_phases.sh"  # phase DIR NAME MAX_SECONDS COMMAND...

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
} > "$OUT/phases.txt" 2>&1
cat "$OUT/phases.txt"

phase "$RUNS" smoke 150 $PY -m pytest -q -p no:cacheprovider tests/test_step_decoder.py -k "cuda"

phase "$OUT" modes 260 $PY scripts/bench_decode_modes.py --preset "$PRESET" --target-steps "$TARGET_STEPS" \
  --eagle1-dir "$RUNS/eagle1" --modes graphs,hf_static,compiled --prompts 6 --out "$OUT/gpu_modes.json" \
  eval.num_prompts="$PROMPTS"

phase "$RUNS" smoke_tiny 150 $PY scripts/bench_decode.py --preset tiny --no-eager-steps \
  --methods lookup,eagle1,dflash,peagle,medusa-chain,draft_model --out "$OUT/smoke_tiny.json" eval.num_prompts=3 \
  eval.hf_baselines=false eval.drafter_dtype=bfloat16 || exit 4

phase "$OUT" core 330 $PY scripts/bench_decode.py --preset "$PRESET" --target-steps "$TARGET_STEPS" \
  --methods lookup,eagle1 --eagle1-dir "$RUNS/eagle1" --out "$OUT/gpu_core.json" eval.num_prompts="$PROMPTS" \
  decoder.compile=off

phase "$OUT" parallel 400 $PY scripts/bench_decode.py --preset "$PRESET" --target-steps "$TARGET_STEPS" \
  --methods eagle1,dflash,peagle --no-eager-steps --eagle1-dir "$RUNS/eagle1_regen" --dflash-dir "$RUNS/dflash" \
  --peagle-dir "$RUNS/peagle" --out "$OUT/gpu_parallel.json" eval.num_prompts="$PROMPTS" eval.hf_baselines=false \
  data.mode=regenerate regenerate.num_prompts=512 regenerate.batch_size=128 regenerate.engine=batched \
  regenerate.temperature=0 decoder.compile=off
echo "done after $(( $(date +%s) - start ))s"
