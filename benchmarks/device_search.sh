#!/usr/bin/env bash
# A search (or `cowtune confirm`) on the GPU machine of the `device` tool, which keeps nothing between leases and
# copies the working tree again at every call. Each call runs one step, from the repository root there:
#
#   carry [".devbundle/site.tar.xz"]:  bash benchmarks/device_search.sh install
#   carry [".devdata"]:                COWTUNE_COMMIT=<sha> bash benchmarks/device_search.sh start  -- ARGS of search_spaces/cifar10_cowmix.py
#   (no carry):                        bash benchmarks/device_search.sh poll   # prints progress, copies the store
#   (no carry):                        bash benchmarks/device_search.sh finish NAME   # promote, copy everything
#   carry [".devdata", "<store>"]:     bash benchmarks/device_search.sh confirm STORE_TAR NAME N   # more seeds
#
# `start` copies the code to /tmp/cowtune-code first: a later call's fresh tree never changes a running search. The
# search runs in /tmp/s (its mlflow.db, mlruns/ and ray_results/ there) under setsid, so it outlives the call. `poll`
# and `finish` copy the MLflow store (database and small artifacts, no checkpoints) to $OUT as store.tar.gz, so a
# lease that ends early still leaves every finished trial's record here.
set -euo pipefail
step=${1:?install, start, poll, finish or confirm}; shift
S=/tmp/s
CODE=/tmp/cowtune-code
REPO=$PWD

site() {   # the bundle's PYTHONPATH (install reuses what an earlier call of this lease unpacked); none where they are
    if ! python3 -c "import ray, optuna, mlflow" 2>/dev/null; then
        eval "$(python3 "$REPO/benchmarks/device_bundle.py" install --target /tmp/site)"
    fi
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$CODE
    if [ -f $CODE/COMMIT ]; then export COWTUNE_COMMIT=$(cat $CODE/COMMIT); fi   # the runs' mlflow.source.git.commit
}

copy_code() {   # the code away from the tree the next call replaces
    rm -rf $CODE && mkdir -p $CODE $S && cp -r trainables search_spaces benchmarks pyproject.toml $CODE/
    # the device's copy has no .git: the caller says which commit (COWTUNE_COMMIT=<sha> bash ... start ...)
    echo "${COWTUNE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" > $CODE/COMMIT
}

store_out() {   # the MLflow store to $OUT (no checkpoints), and the log's tail
    [ -n "${OUT:-}" ] || return 0
    (cd $S && tar -czf "$OUT/store.tar.gz" --exclude='*checkpoint*' --exclude='*.pt' mlflow.db mlartifacts mlruns 2>/dev/null || true)
    cp $S/search.log "$OUT/" 2>/dev/null || true
}

case $step in
install)
    site
    python3 -c "import ray, optuna, mlflow; print('ray', ray.__version__, 'optuna', optuna.__version__, 'mlflow', mlflow.__version__)"
    nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
    ;;
start)
    [ "${1:-}" = "--" ] && shift
    copy_code
    site
    cp .devdata/train.zip $S/
    cd $S
    setsid nohup python3 $CODE/search_spaces/cifar10_cowmix.py --data $S/train.zip "$@" > $S/search.log 2>&1 < /dev/null &
    sleep 45
    tail -n 25 $S/search.log
    ;;
poll)
    site
    tail -n "${1:-30}" $S/search.log
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader || true
    store_out
    ;;
finish)
    name=${1:?the search name}
    site
    cd $S
    python3 -m trainables.cli promote --search "$name" --out "$OUT/promoted.yaml"
    store_out
    ;;
confirm)
    store=${1:?the store tarball}; name=${2:?the search name}; seeds=${3:?seeds in all}; shift 3
    copy_code
    site
    cp .devdata/train.zip $S/ && tar -xzf "$store" -C $S
    cd $S
    setsid nohup python3 -m trainables.cli confirm --search "$name" --seeds "$seeds" "$@" > $S/search.log 2>&1 < /dev/null &
    sleep 45
    tail -n 25 $S/search.log
    ;;
*)
    echo "device_search.sh: unknown step '$step' (install, start, poll, finish, confirm)" >&2; exit 2
    ;;
esac
