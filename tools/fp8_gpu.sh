#!/usr/bin/env bash
# The FP8 KV cache (--kv-cache-dtype fp8_e4m3) on one GPU, in steps (JSON and logs under $OUT):
#
#   OUT=/some/dir STEPS="tests decode" bash tools/fp8_gpu.sh
#
#   tests    the GPU tests of the FP8 cache's kernels (decode, verify, sparse MLA, indexer scores, a
#            captured decode) and of the model dtype's MLA and indexer kernels beside them
#   decode   bench one-batch, DeepSeek-V3 shapes (4 layers, FP8 weights, dummy load), 256 sequences
#            over 2K and 8K tokens with --kv-cache-dtype auto and fp8_e4m3: the decode step's time
#            and the pool's capacity in tokens (sized from memory, as a server's)
#   summary  the decode step's figures and the pool's capacity of each run, FP8 against auto
# Run from the repository root with the machine's python3 (torch with CUDA, Triton). The image lacks
# the HTTP stack the CLI imports: carry cp312 wheels in tmp/wheels (as tools/v32_gpu.sh says); they
# are installed into /tmp/site.
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail
OUT="${OUT:-$PWD/tmp/fp8_gpu}"
CONTEXTS="${CONTEXTS:-2048 8192}"
BATCH="${BATCH:-256}"
M="python3 -m moeserve.server.cli"
status=0
# shellcheck source=tools/step.sh
source "$(dirname "$0")/step.sh"
gpu_setup fp8_gpu.log
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
for s in ${*:-${STEPS:-tests decode summary}}; do
    case $s in
    tests)
        # shellcheck disable=SC2086
        step tests "${TESTS_LIMIT:-400}" python3 -m pytest -p no:cacheprovider -q -rfE -m gpu --durations=10 \
            ${TESTS:-tests/kernels/test_fp8_kv.py tests/kernels/test_triton_mla.py tests/kernels/test_indexer.py} ;;
    decode)
        for n in $CONTEXTS; do
            for kv in auto fp8_e4m3; do
                step "decode-$kv-$n" "${BENCH_LIMIT:-500}" $M bench one-batch --preset dsv3 --num-layers 4 \
                    --load-format dummy --quantization fp8 --kv-cache-dtype "$kv" --batch-size "$BATCH" \
                    --input-len "$n" --output-len "${OUTPUT_LEN:-16}" --max-prefill-tokens 16384 \
                    --json "$OUT/decode_${kv}_$n.json"
            done
        done ;;
    summary)
        python3 - "$OUT" $CONTEXTS <<'EOF'
import json, os, sys

out, contexts = sys.argv[1], sys.argv[2:]
print(f"{'context':>8} {'kv cache':>9} {'pool tokens':>12} {'decode ms':>10} {'decode tok/s':>13} {'peak GB':>8}")
for n in contexts:
    pool = {}
    for kv in ("auto", "fp8_e4m3"):
        path = os.path.join(out, f"decode_{kv}_{n}.json")
        if not os.path.exists(path):
            continue
        r = json.load(open(path))["results"][0]
        pool[kv] = r["kv_cache_tokens"]
        print(f"{n:>8} {kv:>9} {r['kv_cache_tokens']:>12} {r['decode_step_ms'] or 0:>10.3f} "
              f"{r['decode_tok_s'] or 0:>13.1f} {r['peak_memory_gb'] or 0:>8.2f}")
    if len(pool) == 2:
        print(f"{n:>8} pool tokens fp8_e4m3 / auto = {pool['fp8_e4m3'] / pool['auto']:.3f} (596 vs 1,152 bytes)")
EOF
        ;;
    *) echo "unknown step $s"; status=1 ;;
    esac
done
exit $status
