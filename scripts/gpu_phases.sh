# Sourced by the one-command GPU benches (bench_decode_gpu.sh, bench_train_gpu.sh): phases run under a deadline, each
# logged, with a summary in $OUT/phases.txt. Needs OUT and DEADLINE_S set; starts the clock when sourced.
start=$(date +%s)
left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }
phase() {  # phase DIR NAME MAX_SECONDS COMMAND...: run under the smaller of MAX_SECONDS and the time left, log
  local dir=$1 name=$2 max=$3 budget  # in DIR/NAME.log
  shift 3
  budget=$(left)
  (( budget > max )) && budget=$max
  if (( budget < 20 )); then
    echo "== $name: skipped, ${budget}s left" | tee -a "$OUT/phases.txt"
    return 124
  fi
  echo "== $name: up to ${budget}s (at $(( $(date +%s) - start ))s)" | tee -a "$OUT/phases.txt"
  timeout --signal=INT --kill-after=15 "$budget" "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc after $(( $(date +%s) - start ))s" | tee -a "$OUT/phases.txt"
  tr '\r' '\n' < "$dir/$name.log" | grep -v 'it/s\]$' | grep -v '^train:' | tail -n 25 | tee -a "$OUT/phases.txt"
  return $rc
}
