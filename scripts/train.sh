#!/usr/bin/env bash
# Launch `python -m train` on N processes of this node (or of several nodes) with torchrun, every rank sharing one
# Hydra run dir (a timestamped default would differ between ranks started a second apart). Extra arguments are
# Hydra overrides; without a trainer= override, trainer=ddp.
#
#   scripts/train.sh experiment=eagle3_llama3_8b data.path=sharegpt.jsonl   # every GPU of this node, DDP
#   NPROC=2 scripts/train.sh trainer=fsdp trainer.device=cpu       # 2 CPU processes (gloo)
#   NNODES=2 MASTER_ADDR=node0 SPECDRAFT_RUN_DIR=/shared/runs/x scripts/train.sh trainer=zero2   # on each node
#   LAUNCHER=deepspeed scripts/train.sh trainer=zero3              # the deepspeed launcher instead of torchrun
#
# A killed run continues where it stopped when relaunched with the same SPECDRAFT_RUN_DIR (trainer.resume=auto).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ -z "${NPROC:-}" ]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [ "${NPROC:-0}" -ge 1 ] || NPROC=1
fi
NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ] && [ -z "${SPECDRAFT_RUN_DIR:-}" ]; then
  echo "scripts/train.sh: NNODES=$NNODES needs SPECDRAFT_RUN_DIR on a filesystem every node shares" >&2
  exit 2
fi
export SPECDRAFT_RUN_DIR=${SPECDRAFT_RUN_DIR:-runs/$(date +%Y-%m-%d/%H-%M-%S)}

args=("$@")
case " $* " in
  *" trainer="*) ;;
  *) args=("trainer=ddp" "${args[@]}") ;;
esac

echo "run dir: $SPECDRAFT_RUN_DIR ($NNODES node(s) x $NPROC process(es))" >&2
if [ "${LAUNCHER:-torchrun}" = deepspeed ]; then
  # --no_local_rank: the launcher would otherwise append --local_rank, which Hydra rejects (LOCAL_RANK is exported).
  exec "$(dirname "$PY")/deepspeed" --num_gpus "$NPROC" --no_local_rank --module train "${args[@]}"
fi
if [ "$NNODES" -eq 1 ]; then
  exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m train "${args[@]}"
fi
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$NPROC" \
  --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR to node 0}:${MASTER_PORT:-29500}" \
  --rdzv_id "${RDZV_ID:-$(basename "$SPECDRAFT_RUN_DIR")}" -m train "${args[@]}"
