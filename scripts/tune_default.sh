#!/usr/bin/env bash
# kvq tune on the default model (docs/calibration.md), on one GPU:
#   bash scripts/tune_default.sh sensitivity   # single-tensor sensitivities, SHARDS processes side by side
#   bash scripts/tune_default.sh plans         # plans at several budgets; the 3- and 5-bit ones validated
#   bash scripts/tune_default.sh eval          # kvq eval: the plans beside the uniform formats, bins to 8192
#   bash scripts/tune_default.sh eval-gpu      # the same in the model dtype on a GPU, in two runs (each fits a
#                                              # 10-minute slot on an H200), merged (docs/results/tune/eval_h200)
# (no argument: all three).  Everything runs in float32 (on a GPU: the torch reference attention), where
# the KL of a single 8- or 4-bit tensor is not drowned by bfloat16 rounding.  The sensitivity reads the last 2 x 1025 tokens of kvq's reference text; the
# validation and the eval score only its start (4 passages), so what is scored is held out.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${TUNE_OUT:-docs/results/tune}
shards=${SHARDS:-8}
budgets=${BUDGETS:-"3 3.5 4 5 6"}
common=(--model default --block-size 32 --kv-sink-tokens 4 --kv-residual-tokens 128 --context 1024 --scored 128
        --passages 2)
stage=${1:-all}
kvq=${KVQ:-python3 -m kvq}
mkdir -p "$out/plans"
if [ "$stage" = sensitivity ] || [ "$stage" = all ]; then
  for k in $(seq 0 $((shards - 1))); do
    $kvq tune "${common[@]}" --shard "$k/$shards" --save-sensitivity "$out/sensitivity_shard$k.json" --threads 2 \
      > "$out/shard$k.log" 2>&1 &
  done
  wait
  parts=$(ls "$out"/sensitivity_shard*.json | paste -sd,)
  $kvq tune "${common[@]}" --sensitivity "$parts" --budget 5 --no-validate --save-sensitivity "$out/sensitivity.json" \
    --out "$out/plans/tuned-5.json"
  tail -n 3 "$out"/shard*.log
  rm -f "$out"/sensitivity_shard*.json "$out"/shard*.log
fi
if [ "$stage" = plans ] || [ "$stage" = all ]; then
  for b in $budgets; do
    case "$b" in
      3|5) $kvq tune "${common[@]}" --sensitivity "$out/sensitivity.json" --budget "$b" --no-progress \
             --validate-out "$out/validate-$b" --out "$out/plans/tuned-$b.json" ;;
      *) $kvq tune "${common[@]}" --sensitivity "$out/sensitivity.json" --budget "$b" --no-validate \
           --out "$out/plans/tuned-$b.json" ;;
    esac
  done
fi
if [ "$stage" = eval ] || [ "$stage" = all ]; then
  plans=$(ls "$out"/plans/*.json | paste -sd,)
  $kvq eval --kv-cache-dtype int2_kivi:r128:s4,int4_kivi:r128:s4,fp8_e4m3:r128:s4 \
    --kv-cache-plan "$plans" --bins 512,2048,4096,8192 --passages 4 --block-size 32 --dtype float32 \
    --passkey-trials 0 --no-progress --out "$out/eval"
  python3 scripts/tune_table.py "$out/eval/results.json"
fi
if [ "$stage" = eval-gpu ]; then
  plans=$(ls "$out"/plans/*.json | paste -sd,)
  uniform=int2_kivi,int2_per_token,int4_kivi,int4_per_token,fp8_e4m3,fp8_e5m2,fp8_per_block,int8,fp8_per_token_head
  uniform=$(echo "$uniform,int8_per_token_head" | sed 's/\([a-z0-9_]*\)/\1:r128:s4/g')
  args=(--bins 512,2048,4096,8192 --passages 4 --block-size 32 --passkey-trials 0 --no-progress)
  $kvq eval --kv-cache-dtype "$(echo "$uniform" | cut -d, -f1,3,5)" --kv-cache-plan "$plans" "${args[@]}" \
    --out "$out/eval_gpu_a"
  $kvq eval --kv-cache-dtype "$(echo "$uniform" | cut -d, -f2,4,6-)" "${args[@]}" --out "$out/eval_gpu_b"
  python3 scripts/merge_eval.py "$out/eval_h200" "$out/eval_gpu_a/results.json" "$out/eval_gpu_b/results.json"
  $kvq eval --report-only --out "$out/eval_h200"
  python3 scripts/tune_table.py "$out/eval_h200/results.json"
fi
