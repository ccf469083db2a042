#!/usr/bin/env bash
# A long run on the GPU machine, outliving the 10-minute limit of one `device` call: start it detached, then wait
# on it from back-to-back calls (the machine stays warm only 30 s between calls), copying what it wrote to $OUT.
#
#   bash benchmarks/detached.sh start DIR -- CMD [ARG ...]    # CMD's output goes to DIR/log.txt; returns at once
#   bash benchmarks/detached.sh wait DIR SECONDS [FILE ...]    # until CMD ends or SECONDS pass; then DIR/log.txt,
#                                                              # DIR/gpu.txt and each FILE are copied to $OUT
#
# `wait` prints the log's tail and the last lines of any metrics.jsonl among the FILEs, and exits 0 once CMD has
# ended (its exit status is the log's last line, "rc=N"), 3 while it still runs. Example (docs/RESULTS.md):
#   bash benchmarks/detached.sh start /tmp/dp -- python3 benchmarks/data_parallel_epoch.py ... --out /tmp/dp/run
#   bash benchmarks/detached.sh wait /tmp/dp 560 /tmp/dp/run/metrics.jsonl /tmp/dp/run/summary.json
set -uo pipefail
verb=${1:?start or wait}; dir=${2:?a folder for the log}; shift 2
case "$verb" in
start)
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { echo "detached.sh: start needs a command after --" >&2; exit 2; }
    mkdir -p "$dir"
    if grep -qs . "$dir/pid" && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
        echo "detached.sh: $dir already has a run going (pid $(cat "$dir/pid"))" >&2; exit 2
    fi
    rm -f "$dir/log.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$dir/gpu.txt" 2>&1 || true
    setsid bash -c '"$@" > "$0/log.txt" 2>&1; echo "rc=$?" >> "$0/log.txt"' "$dir" "$@" < /dev/null > /dev/null 2>&1 &
    echo $! > "$dir/pid"
    echo "started pid $(cat "$dir/pid") at $(date -u '+%Y-%m-%d %H:%M:%S UTC'): $*"
    ;;
wait)
    seconds=${1:?seconds to wait}; shift
    t0=$(date +%s)
    until grep -qs '^rc=' "$dir/log.txt" || [ $(( $(date +%s) - t0 )) -ge "$seconds" ]; do sleep 5; done
    out=${OUT:-$dir/out}
    mkdir -p "$out"
    cp "$dir/log.txt" "$dir/gpu.txt" "$@" "$out"/ 2>/dev/null
    date -u '+%Y-%m-%d %H:%M:%S UTC'
    tail -c 1500 "$dir/log.txt" 2>/dev/null
    for f in "$@"; do
        case "$f" in *metrics.jsonl) [ -f "$f" ] && { echo "--- $f"; tail -n 3 "$f" | cut -c1-400; } ;; esac
    done
    grep -qs '^rc=' "$dir/log.txt" || { echo "still running"; exit 3; }
    ;;
*)
    echo "detached.sh: the first argument is start or wait, got '$verb'" >&2; exit 2
    ;;
esac
