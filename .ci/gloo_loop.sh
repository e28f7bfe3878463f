#!/usr/bin/env bash
# Run every test file that starts gloo processes N times in a row while .ci/port_grabber.py keeps
# taking ephemeral ports (issue 31's check for port races and teardown aborts). Not part of
# `make test`: a run takes ~11 min on 2 cores.
#
#   .ci/gloo_loop.sh N [LOG_DIR]      # one summary line per run in LOG_DIR/summary.txt
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
runs=${1:?usage: .ci/gloo_loop.sh N [LOG_DIR]}
logs=${2:-$(mktemp -d)}
mkdir -p "$logs"
# the files that call tests.multiproc (run, run_jobs, torchrun, launcher_port), torchrun or the
# launch scripts, and the benchmark harness's gloo worlds
mapfile -t files < <(grep -rlE "multiproc|torchrun|launch/|gloo_world|run_collectives" tests \
    --include='test_*.py' | sort)
.venv/bin/python .ci/port_grabber.py --minutes $((runs * 60)) > "$logs/grabber.log" 2>&1 &  # the trap stops it
grabber=$!
trap 'kill $grabber 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
    start=$(date +%s)
    CI=true .venv/bin/python -m pytest -q -p no:cacheprovider "${files[@]}" > "$logs/run_$i.log" 2>&1
    rc=$?
    echo "run $i: rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$logs/run_$i.log")" \
        "aborts=$(grep -c 'terminate called' "$logs/run_$i.log")" \
        "EADDRINUSE=$(grep -c EADDRINUSE "$logs/run_$i.log")" | tee -a "$logs/summary.txt"
done
