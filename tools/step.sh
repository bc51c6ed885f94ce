# shellcheck shell=bash
# step NAME LIMIT CMD...: run CMD under a wall-clock LIMIT (seconds; SIGINT first, so pytest tears
# its processes down, SIGKILL ${STEP_KILL_AFTER:-10} s later), report its exit and time, and keep
# the first failure in $status. Sourced by the GPU scripts beside it.
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo; echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    timeout -s INT -k "${STEP_KILL_AFTER:-10}" "$limit" "$@"
    rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
    return 0
}

# gpu_setup LOG: everything printed from here on also goes to $OUT/LOG; the carried cp312 wheels of
# the HTTP stack (tmp/wheels, which the GPU image lacks) are installed into /tmp/site (on PYTHONPATH).
gpu_setup() {
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/$1") 2>&1
    if [ -d tmp/wheels ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site tmp/wheels/*.whl || status=1
    fi
}
