#!/usr/bin/env bash
# The front end at node scale on one GPU: what clients receive against the engine's own decode step,
# side by side in one run (DeepSeek-V3 shapes, FP8, random weights; JSON and logs under $OUT):
#
#   OUT=/some/dir STEPS="engine serve" bash tools/frontend_gpu.sh
#
#   engine    bench one-batch decode steps: 4 layers at 64 / 256 / 512 sequences, 2 layers (one dense,
#             one MoE: the engine is not the limit) at 1,024 / 2,048; 128-token prompts
#   serve     moeserve serve, bench serving with --max-concurrency = streams (one request each,
#             128-token prompts, 512 output tokens): 4 layers with --api-workers 1 (the baseline) and
#             $WORKERS, at 64 / 256 / 512 streams; 2 layers with $WORKERS at 1,024 / 2,048 streams
#   scripted  bench frontend: the API processes alone, over scripted leaders at a 10 ms step
#
# The image lacks the HTTP stack: carry cp312 wheels (fastapi, uvicorn, uvloop, httptools, pyzmq,
# msgspec, prometheus_client, httpx and their dependencies) in tmp/wheels; installed into /tmp/site.
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail
OUT="${OUT:-$PWD/tmp/frontend_gpu}"
WORKERS="${WORKERS:-6}"
CLIENTS="${CLIENTS:-6}"
OUTPUT_LEN="${OUTPUT_LEN:-512}"
M="python3 -m moeserve.server.cli"
status=0
# shellcheck source=tools/step.sh
source "$(dirname "$0")/step.sh"
gpu_setup frontend_gpu.log
mkdir -p "$OUT/logs"
python3 tools/dsv3_config.py /tmp/dsv3-4l --layers 4
python3 tools/dsv3_config.py /tmp/dsv3-2l --layers 2
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1) $(git rev-parse --short HEAD 2>/dev/null) $(nproc) CPUs"

# serve_rows NAME MODEL MAX_RUNNING API_WORKERS STREAMS...: one server, a bench serving run per STREAMS
serve_rows() {
    local name=$1 model=$2 running=$3 workers=$4
    shift 4
    local ports="$OUT/logs/$name.ports" log="$OUT/logs/$name.log"
    rm -f "$ports"
    $M serve --model-path "$model" --load-format dummy --device cuda --quantization fp8 --context-length 4096 \
        --max-running-requests "$running" --cuda-graph-max-bs "$running" --chunked-prefill-size 16384 \
        --max-queued-requests 8192 --mem-fraction-static 0.85 --api-workers "$workers" --port 0 \
        --port-file "$ports" > "$log" 2>&1 &
    local pid=$! start=$SECONDS
    until [ -f "$ports" ] && python3 -c "import json, urllib.request as u
u.urlopen(f'http://127.0.0.1:{json.load(open(\"$ports\"))[\"port\"]}/health', timeout=2)" 2> /dev/null; do
        if ! kill -0 $pid 2> /dev/null || (( SECONDS - start > ${START_LIMIT:-300} )); then
            echo "=== $name did not start"; tail -30 "$log"; kill $pid 2> /dev/null; status=1; return
        fi
        sleep 1
    done
    echo "=== $name ready after $((SECONDS - start))s: $(grep -m1 'engine ready' "$log")"
    local url="http://127.0.0.1:$(python3 -c "import json;print(json.load(open('$ports'))['port'])")"
    for n in "$@"; do
        local clients=$(( n < CLIENTS ? n : CLIENTS ))
        step "$name-$n" "${BENCH_LIMIT:-150}" $M bench serving --base-url "$url" --num-prompts "$n" \
            --max-concurrency "$n" --random-input-len 128 --random-output-len "$OUTPUT_LEN" --random-range-ratio 1 \
            --client-processes "$clients" --disable-tqdm --output-json "$OUT/serve_${name}_$n.json"
    done
    kill -TERM $pid; wait $pid
}

for s in ${*:-${STEPS:-engine serve}}; do
    case $s in
    engine)
        step engine-4l "${BENCH_LIMIT:-240}" $M bench one-batch --preset dsv3 --num-layers 4 --quantization fp8 \
            --batch-size 64 256 512 --input-len 128 --output-len 64 --json "$OUT/engine_4l.json"
        step engine-2l "${BENCH_LIMIT:-240}" $M bench one-batch --preset dsv3 --num-layers 2 --quantization fp8 \
            --batch-size 1024 2048 --input-len 128 --output-len 64 --json "$OUT/engine_2l.json" ;;
    serve)
        serve_rows 4l-w1 /tmp/dsv3-4l 512 1 64 256 512
        serve_rows "4l-w$WORKERS" /tmp/dsv3-4l 512 "$WORKERS" 64 256 512
        serve_rows "2l-w$WORKERS" /tmp/dsv3-2l 2048 "$WORKERS" 1024 2048 ;;
    scripted)
        step scripted "${BENCH_LIMIT:-400}" $M bench frontend --streams 256 1024 2048 --api-workers 1 "$WORKERS" \
            --step-ms 10 --output-len 300 --waves 1 --client-processes "$CLIENTS" --output-json "$OUT/scripted.json" ;;
    *) echo "unknown step $s"; status=1 ;;
    esac
done
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "=== done, status $status"
exit $status
