#!/usr/bin/env bash
# The one-rank emulator on one GPU, in steps (each writes JSON under $OUT):
#
#   OUT=/some/dir STEPS="validate prefill decode" bash tools/rank_gpu.sh
#   OUT=/some/dir bash tools/rank_gpu.sh validate        # steps as arguments work too
#
#   validate  at EP 1 (4 layers, all 256 experts here, FP8): bench rank's step beside bench
#             one-batch's at the same shapes (decode: 128 sequences over 2,000 tokens; prefill:
#             8 x 2,000 tokens in one pass)
#   prefill   bench deployment --reference sglang-96xh100 --roles prefill (61 layers, EP32 share)
#   decode    bench deployment --reference sglang-96xh100 --roles decode (61 layers, EP72 share)
# Run from the repository root with the machine's python3 (torch with CUDA, Triton).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail
OUT="${OUT:-$PWD/tmp/rank_gpu}"
REPEATS="${REPEATS:-5}"
mkdir -p "$OUT"
M="python3 -m moeserve.server.cli"
status=0
for s in ${*:-${STEPS:-validate prefill decode}}; do
    case $s in
    validate)
        # one-batch: batch 8 gives the prefill (16,000 tokens in one pass), batch 128 the decode step
        $M bench one-batch --preset dsv3 --num-layers 4 --quantization fp8 --batch-size 8 128 --input-len 2000 \
            --output-len 16 --json "$OUT/one_batch.json" || status=1
        $M bench rank --num-layers 4 --quantization fp8 --role decode --ep-size 1 --batch-per-rank 128 \
            --context 2000 --repeats "$REPEATS" --json "$OUT/rank_ep1_decode.json" || status=1
        $M bench rank --num-layers 4 --quantization fp8 --role prefill --ep-size 1 --tokens-per-rank 16000 \
            --input-len 2000 --repeats "$REPEATS" --json "$OUT/rank_ep1_prefill.json" || status=1 ;;
    prefill|decode)
        $M bench deployment --reference sglang-96xh100 --roles "$s" --repeats "$REPEATS" --profile \
            --json "$OUT/deployment_$s.json" || status=1 ;;
    *) echo "unknown step $s"; status=1 ;;
    esac
done
exit $status
