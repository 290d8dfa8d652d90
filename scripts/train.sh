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
# A killed or signalled run continues where it stopped when relaunched with the same SPECDRAFT_RUN_DIR
# (trainer.resume=auto).
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

# A signal to the launcher reaches every rank, which finishes its step, checkpoints and exits 128+signal
# (train/preemption.py): torchrun passes on SIGUSR1 (Slurm's warning before a time limit) and SIGHUP (the ssh session
# that started it closed) too, and waits for the checkpoint (TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds) before it kills
# anything.
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}

echo "run dir: $SPECDRAFT_RUN_DIR ($NNODES node(s) x $NPROC process(es))" >&2
if [ "${LAUNCHER:-torchrun}" = deepspeed ]; then
  # --no_local_rank: the launcher would otherwise append --local_rank, which Hydra rejects (LOCAL_RANK is exported).
  exec "$(dirname "$PY")/deepspeed" --num_gpus "$NPROC" --no_local_rank --module train "${args[@]}"
fi

# Runs the launcher in the background so that a signal sent to this script reaches it, and this script then exits
# as its ranks did (128+signal: 143 for SIGTERM), not with the launcher's own status for being signalled (1).
# SIGINT is only recorded: Ctrl-C already reaches every process of the terminal's process group.
launch() {
  "$@" &
  local child=$! rc=0
  for sig in TERM USR1 HUP; do
    trap "got=$sig; kill -$sig $child 2>/dev/null || true" "$sig"
  done
  trap 'got=INT' INT
  while true; do
    rc=0
    wait "$child" || rc=$?
    kill -0 "$child" 2>/dev/null || break  # a trapped signal interrupts wait: wait again while the launcher runs
  done
  if [ "$rc" -ne 0 ] && [ -n "${got:-}" ]; then
    exit $((128 + $(kill -l "$got")))
  fi
  exit "$rc"
}

if [ "$NNODES" -eq 1 ]; then
  launch "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m train "${args[@]}"
fi
launch "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$NPROC" \
  --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR to node 0}:${MASTER_PORT:-29500}" \
  --rdzv_id "${RDZV_ID:-$(basename "$SPECDRAFT_RUN_DIR")}" -m train "${args[@]}"
