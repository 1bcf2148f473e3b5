#!/usr/bin/env bash
# The ZeRO-3 memory plan against the peaks a run measures on this machine: `plan` at RATIO
# (default: what `plan --ratio auto` picks here), benchmarks/suite.py at that ratio, then per
# rank the planned and measured GPU (torch-allocated) and host (RSS) peaks and their gap.
#
#   bash dev/plan_vs_measured.sh llama-3.1-8b 1          # one H100: auto's ratio
#   bash dev/plan_vs_measured.sh llama-3.1-8b 1 0.9      # a given ratio
#   bash dev/plan_vs_measured.sh qwen3-14b 2 0.85        # 2 x H200
#
# Run from the repo root on the GPU machine with `.whl/` beside the checkout (dev/gpu_env.sh);
# one command each (under 600 s). Writes under $OUT (default ./results).
# The plan's host peak counts a resume (memory_plan.resume_extra_host_bytes), and so does the
# optimizer's host check at start; this script measures training. PLAN_CPU_MEM (GiB) plans for
# another host size than this one.
set -u
MODEL="${1:?model: a shipped config name, e.g. llama-3.1-8b}"
GPUS="${2:-1}"
RATIO="${3:-auto}"
OUT="${OUT:-results}"
mkdir -p "$OUT"
source dev/gpu_env.sh || exit 1
find ~/.cache -name lock -delete 2>/dev/null  # a build killed with an earlier call's machine

host=()
[ -n "${PLAN_CPU_MEM:-}" ] && host=(--cpu-mem "$PLAN_CPU_MEM")
python -m hf_superoffload plan "$MODEL" --gpus "$GPUS" ${host[@]+"${host[@]}"} --ratio "$RATIO" --json \
    > "$OUT/plan.json" 2> "$OUT/plan.err"
case $? in
  0) ;;
  1) echo "plan: does not fit here: $(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["reasons"])' "$OUT/plan.json")" >&2
     exit 1 ;;
  *) cat "$OUT/plan.err" >&2; exit 2 ;;
esac
RATIO=$(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["run"]["ratio"])' "$OUT/plan.json")
echo "ratio $RATIO"
# shellcheck disable=SC2086
timeout 540 python benchmarks/suite.py --model-config "hf_superoffload/model_configs/$MODEL.json" \
    --seq 4096 --batch 4 --steps 4 --warmup 1 --superoffload-warmup 1 --clip 1.0 --nproc "$GPUS" \
    --ratio "$RATIO" --systems superoffload_zero3 --out-dir "$OUT/suite" --timeout 520 | tail -2
python - "$OUT/plan.json" "$OUT/suite/suite.csv" <<'PY'
import csv, json, sys
plan = json.load(open(sys.argv[1]))
gib = 2**30
rows = [r for r in csv.DictReader(open(sys.argv[2])) if r["system"] == "superoffload_zero3"]
row = rows[-1]
if row["status"] != "ok":
    sys.exit(f"the run did not finish: {row['status']} {row['error']}")
ranks = (json.loads(row["ranks"]) if row.get("ranks") else None) or [row]  # per rank
gpu = max(float(r["peak_gpu_gib"]) for r in ranks)
host = max(float(r["peak_host_rss_gib"]) for r in ranks)
planned_gpu = plan["gpu_total_bytes"] / gib
planned_host = max(plan["host_training_bytes_per_rank"], plan["host_start_up_bytes_per_rank"]) / gib
print(f"{plan['model']['name']} on {plan['run']['ranks']} GPU(s), ratio {plan['run']['ratio']}, "
      f"{plan['sub_groups']['on_gpu']} of {plan['sub_groups']['count']} sub groups on the GPU")
for what, planned, measured in (("GPU (allocated)", planned_gpu, gpu), ("host (RSS)", planned_host, host)):
    gap = planned / measured - 1
    print(f"  {what:<16} plan {planned:6.2f} GiB  measured {measured:6.2f} GiB  {gap:+.1%}  "
          f"{'within 5%' if abs(gap) <= 0.05 else 'OFF BY MORE THAN 5%'}")
print(f"  GPU need with headroom {plan['gpu_need_bytes'] / gib:.1f} of {plan['hardware']['gpu_memory_bytes'] / gib:.1f} GiB; "
      f"host resume peak {plan['host_resume_bytes_per_rank'] / gib:.1f} GiB per rank (not measured here)")
print(f"  suite's own plan (one group, persistence 1e5): {row.get('plan_per_rank')}; s/step {row['s_per_step']}")
PY
