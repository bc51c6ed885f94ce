#!/usr/bin/env bash
# The prefix cache on one GPU, DeepSeek-V3 shapes, 4 layers, FP8, random weights: the same
# shared-prefix load against one server with the cache on and off (tools/prefix_cache_gpu.py).
#
#   OUT=/some/dir bash tools/prefix_cache_gpu.sh
#
# The image lacks the HTTP stack: carry cp312 wheels of fastapi, uvicorn, pyzmq, msgspec (and their
# dependencies) in WHEELS (default .whl: `pip download --only-binary=:all: --python-version 3.12 -d .whl
# fastapi uvicorn pyzmq msgspec prometheus_client httpx`); they are installed into /tmp/site.
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail
OUT="${OUT:-$PWD/tmp/prefix_cache_gpu}"
WHEELS="${WHEELS:-.whl}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/prefix_cache_gpu.log") 2>&1
if [ -d "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
MODEL=/tmp/dsv3-4l
python3 tools/dsv3_config.py "$MODEL" --layers 4
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1) $(git rev-parse --short HEAD 2>/dev/null)"
SERVER="--model-path $MODEL --load-format dummy --device cuda --quantization fp8 --context-length 8192 \
--max-running-requests 256 --cuda-graph-max-bs 256 --chunked-prefill-size 8192 --max-queued-requests 4096 \
--mem-fraction-static 0.85"
timeout "${LIMIT:-500}" python3 tools/prefix_cache_gpu.py --server-args "$SERVER" --log-dir "$OUT/logs" --disable-tqdm \
    --gsp-num-groups "${NUM_GROUPS:-8}" --gsp-prompts-per-group "${PER_GROUP:-32}" --gsp-system-prompt-len "${PREFIX:-2048}" \
    --gsp-question-len "${QUESTION:-128}" --gsp-output-len "${OUTPUT:-128}" --request-rate "${RATE:-inf}" \
    --output-json "$OUT/prefix_cache.json" --plot "$OUT/prefix_cache.png" ${NO_WARM_UP:+--no-warm-up}
status=$?
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "=== done, status $status"
exit $status
