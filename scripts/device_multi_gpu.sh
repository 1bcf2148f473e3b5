#!/usr/bin/env bash
# The multi-GPU checks of the ZeRO-3 path, one stage per device call (each fits the tool's 600 s):
#
#   bash scripts/device_multi_gpu.sh tests       # multi_gpu tests: ZeRO-3 vs DeepSpeed, Ulysses, failure watch
#   bash scripts/device_multi_gpu.sh scaling     # 3.37B on N GPUs (ZeRO-3, replicas) and on 1, same host
#   bash scripts/device_multi_gpu.sh qwen3-14b   # the issue's 2-GPU model: ours, then DeepSpeed ZeRO-Offload
#   bash scripts/device_multi_gpu.sh qwen3-30b-a3b   # the issue's 4-GPU MoE model (needs 4 GPUs), the same
#
# Run from the repo root on a machine with >= 2 GPUs, `.whl` carried (scripts/device_env.sh).
# Writes under $OUT (default ./results): logs, suite.csv, plots; prints a short table last.
set -u
STAGE="${1:?stage: tests, scaling, qwen3-14b or qwen3-30b-a3b}"
OUT="${OUT:-results}"
mkdir -p "$OUT"
source scripts/device_env.sh || exit 1
find ~/.cache -name lock -delete 2>/dev/null
GPUS=$(python -c 'import torch; print(torch.cuda.device_count())')
NEED=2; [ "$STAGE" = qwen3-30b-a3b ] && NEED=4
[ "$GPUS" -ge "$NEED" ] || { echo "stage $STAGE needs >= $NEED GPUs, found $GPUS" >&2; exit 2; }
start=$(date +%s)
python -c "import hf_superoffload.ops as o; o.prepare()" > "$OUT/build_ours.log" 2>&1 &
python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    > "$OUT/build_deepspeed.log" 2>&1 &
wait
echo "CPU Adams built in $(( $(date +%s) - start )) s"

point="--hidden 3072 --layers 28 --seq 4096 --batch 4 --steps 6 --warmup 3 --superoffload-warmup 4 --clip 1.0"
# One of the issue's models on N GPUs of one H200 host (128 GiB of host memory per GPU there):
# the memory plan, then ours at RATIO and DeepSpeed ZeRO-Offload, 10 steps each.
model_stage() {
  local name=$1 gpus=$2 ratio=$3
  python -m hf_superoffload plan "$name" --gpus "$gpus" --gpu-mem 139 --cpu-mem $((128 * gpus)) \
      --ratio "$ratio" > "$OUT/plan.txt" 2>&1
  local model="--model-config hf_superoffload/model_configs/$name.json --seq 4096 --batch 4 --steps 7 --warmup 3 --clip 1.0 --nproc $gpus"
  # shellcheck disable=SC2086
  timeout 330 python benchmarks/suite.py $model --ratio "$ratio" --systems superoffload_zero3 \
      --out-dir "$OUT/suite" --timeout 320 | tail -2
  # shellcheck disable=SC2086
  timeout 200 python benchmarks/suite.py $model --systems deepspeed_zero_offload --out-dir "$OUT/suite" \
      --timeout 190 | tail -2
}

case "$STAGE" in
  tests)
    timeout 420 python -m pytest -m multi_gpu -q -p no:cacheprovider -rs \
        tests/test_zero3_gpu.py tests/test_zero3_ulysses.py tests/test_failure_watch.py \
        tests/test_engine_distributed.py > "$OUT/multi_gpu_tests.log" 2>&1
    tail -8 "$OUT/multi_gpu_tests.log"
    ;;
  scaling)
    # shellcheck disable=SC2086
    timeout 170 python benchmarks/suite.py $point --nproc 2 --systems superoffload_zero3 \
        --out-dir "$OUT/suite" --timeout 160 | tail -2
    # shellcheck disable=SC2086
    timeout 250 python benchmarks/suite.py $point --nproc 1 --systems superoffload_zero3,superoffload \
        --gpu-buckets 0 --out-dir "$OUT/suite" --timeout 120 | tail -3
    ;;
  qwen3-14b)
    # ratio 0.85: the first 15% of the sub groups' state on the GPU (16 B/param there), so the
    # host holds 12.2 B/param (the issue's target: <= 13); the plan says 74.8 of 139 GiB GPU.
    model_stage qwen3-14b 2 0.85
    ;;
  qwen3-30b-a3b)
    # MoE, 30.5B params over 4 ranks of one 512 GiB host: ratio 0.9 plans 12.9 host B/param.
    # Experts without tokens in a step are DeepSpeed's leaf-module case (Qwen3MoeSparseMoeBlock
    # is a default leaf in 0.19.8), tested on CPU in tests/test_zero3_moe.py.
    model_stage qwen3-30b-a3b 4 0.9
    ;;
  *) echo "unknown stage $STAGE: tests, scaling, qwen3-14b or qwen3-30b-a3b" >&2; exit 2 ;;
esac
if [ -f "$OUT/suite/suite.csv" ]; then
  tar -czf "$OUT/suite_logs.tgz" -C "$OUT/suite" logs 2>/dev/null
  python - "$OUT/suite/suite.csv" <<'PY'
import csv, json, sys
print(f"{'system':<20} {'gpus':>4} {'status':<8} {'s/step':>7} {'tok/s/GPU':>9} {'GPU GiB':>7} {'host GiB':>8} plan GPU/host per rank")
for r in csv.DictReader(open(sys.argv[1])):
    plan = json.loads(r["plan_per_rank"]) if r.get("plan_per_rank") else None
    plan = f"{plan['gpu_gib']}/{plan['host_gib']}" if plan else "-"
    print(f"{r['system']:<20} {r['world'] or '?':>4} {r['status']:<8} {r['s_per_step'] or '-':>7} "
          f"{r['tokens_per_s_per_gpu'] or '-':>9} {r['peak_gpu_gib'] or '-':>7} "
          f"{r['peak_host_rss_gib'] or '-':>8} {plan}")
PY
fi
echo "stage $STAGE done in $(( $(date +%s) - start )) s"
