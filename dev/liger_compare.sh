#!/usr/bin/env bash
# Liger-Kernel's kernels against none, through the recipe launcher (`hf-superoffload finetune
# MODEL superoffload --random-init`): the same run twice, without and with
# `--use_liger_kernel true`, random weights, seq 4096, batch 4 per GPU, no model saved. Under
# TRL's SFTTrainer the loss is TRL's fused LM head in both (TRL refuses Liger's fused
# cross-entropy beside it), so the plan (`--loss trl`) and its ratio are the same; Liger adds its
# RMSNorm, RoPE and SwiGLU kernels. Per run: s/step, tokens/s, TFLOPS and MFU per GPU (the
# trainer's log, steps after the first two), torch's allocated and reserved GPU peaks per rank
# (dev/gpu_peak_sitecustomize), nvidia-smi and host peaks of the process tree
# (dev/process_tree_peak.py).
#
#   bash dev/liger_compare.sh qwen3-14b 2 [steps]     # repo root, `.whl` carried (gpu_env.sh)
#
# Env: OUT (default ./results), DEADLINE_S (default 570: both runs share it), PLAN_CPU_MEM (GiB
# of host the plan assumes, default 128 per GPU: the H200 hosts' MemTotal starts low and grows
# with use, so it is not read; the optimizer's host check gets the same figure less 8 GiB),
# PLAN_GPU_MEM (GiB per GPU; default: the GPU's own), DRY_RUN=1 (write and print the runs'
# commands only: a check on a machine without a GPU, with PLAN_GPU_MEM).
# Writes $OUT/liger.csv (a row per run) and $OUT/liger_logs.tgz (logs, plans, peaks, histories);
# prints a short table last.
set -u
MODEL=${1:?model: a recipe name, e.g. qwen3-14b}
GPUS=${2:?gpus}
STEPS=${3:-6}
OUT="${OUT:-results}"
DEADLINE_S=${DEADLINE_S:-570}
BEGAN=$(date +%s)
mkdir -p "$OUT"
WORK=/tmp/liger_compare
rm -rf "$WORK" && mkdir -p "$WORK"
DRY=${DRY_RUN:-0}
if [[ $DRY != 1 ]]; then
  source dev/gpu_env.sh > "$WORK/gpu_env.txt" || exit 1
  find ~/.cache -name lock -delete 2>/dev/null
  python -c "import hf_superoffload.ops as o; o.prepare()" > "$WORK/build_ours.log" 2>&1
fi
PLAN_CPU_MEM=${PLAN_CPU_MEM:-$((128 * GPUS))}
planned=(--cpu-mem "$PLAN_CPU_MEM")
[[ -n ${PLAN_GPU_MEM:-} ]] && planned+=(--gpu-mem "$PLAN_GPU_MEM")
export HF_SUPEROFFLOAD_HOST_MEMORY_GIB=${HF_SUPEROFFLOAD_HOST_MEMORY_GIB:-$((PLAN_CPU_MEM - 8))}

for variant in plain liger; do
  left=$((DEADLINE_S - ($(date +%s) - BEGAN) - 15))
  [[ $variant == plain ]] && left=$((left / 2))  # the same time for each
  ((left > 60)) || { echo "$variant: skipped, $left s left" | tee "$WORK/$variant.log"; continue; }
  flags=()
  [[ $variant == liger ]] && flags=(--use_liger_kernel true)
  runs=$WORK/runs_$variant
  python -m hf_superoffload finetune "$MODEL" superoffload --gpus "$GPUS" --random-init \
    "${planned[@]}" --runs-dir "$runs" --dry-run -- --max_steps "$STEPS" \
    --logging_steps 1 --save_strategy no --save_model false --require_loss_decrease false \
    --loss_plot false ${flags[@]+"${flags[@]}"} > "$WORK/$variant.prepare.log" 2>&1 \
    || { cat "$WORK/$variant.prepare.log"; continue; }
  dir=$(ls -d "$runs"/*/)
  cp "$dir/plan.json" "$WORK/$variant.plan.json"
  cp "$dir/command.sh" "$WORK/$variant.command.sh"
  echo "$variant: $(grep -m1 RATIO=auto "$WORK/$variant.prepare.log" | cut -c1-60) (limit $left s)"
  if [[ $DRY == 1 ]]; then tail -1 "$dir/command.sh"; continue; fi
  GPU_PEAK_DIR="$WORK/$variant.gpu_peak" PYTHONPATH="$PWD/dev/gpu_peak_sitecustomize:$PYTHONPATH" \
    timeout "$left" python dev/process_tree_peak.py "$WORK/$variant.peak.json" -- \
    bash "$dir/command.sh" > "$WORK/$variant.log" 2>&1
  echo "$variant: rc $? after $(($(date +%s) - BEGAN)) s"
  cp "$dir/output/log_history.jsonl" "$WORK/$variant.log_history.jsonl" 2>/dev/null
  grep -E "Error|error:|Killed|out of memory" "$WORK/$variant.log" | tail -3
done

[[ $DRY == 1 ]] && exit 0
python - "$WORK" "$OUT/liger.csv" "$MODEL" "$GPUS" <<'PY'
import csv, glob, json, os, statistics, sys, time
work, csv_path, model, gpus = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
gib = 2**30
rows = []
for variant in ("plain", "liger"):
    row = {"date": time.strftime("%Y-%m-%d"), "model": model, "gpus": gpus, "seq": 4096,
           "batch": 4, "use_liger_kernel": variant == "liger"}
    try:
        plan = json.load(open(f"{work}/{variant}.plan.json"))
        row.update(ratio=plan["run"]["ratio"], loss_planned=plan["run"]["fused_cross_entropy"],
                   plan_gpu_alloc_gib=round(plan["gpu_total_bytes"] / gib, 2),
                   plan_host_training_gib_per_rank=round(plan["host_training_bytes_per_rank"] / gib, 2))
    except OSError:
        pass
    try:
        peak = json.load(open(f"{work}/{variant}.peak.json"))
        row.update(returncode=peak["returncode"], host_peak_gib_all_ranks=peak["anon_shmem_gib"],
                   nvidia_smi_peak_gib=max(peak["gpu_used_gib"] or [0]))
    except OSError:
        row["returncode"] = "not run"
    ranks = [json.load(open(p)) for p in glob.glob(f"{work}/{variant}.gpu_peak/*.json")]
    if ranks:
        row["gpu_alloc_peak_gib"] = round(max(r["max_allocated_bytes"] for r in ranks) / gib, 2)
        row["gpu_reserved_peak_gib"] = round(max(r["max_reserved_bytes"] for r in ranks) / gib, 2)
        row["gpu_peak_ranks"] = len(ranks)
    logs = []
    if os.path.exists(f"{work}/{variant}.log_history.jsonl"):
        logs = [json.loads(x) for x in open(f"{work}/{variant}.log_history.jsonl")]
    steps = [r for r in logs if "tokens_per_second" in r]
    timed = [r for r in steps if r["step"] > 2]
    if timed:
        tokens = {r["step"]: r["num_tokens"] for r in steps}
        per_step = [tokens[r["step"]] - tokens.get(r["step"] - 1, 0) for r in timed]
        row["steps_timed"] = len(timed)
        row["tokens_per_step"] = statistics.median(per_step)
        row["tokens_per_s"] = round(statistics.median(r["tokens_per_second"] for r in timed), 1)
        row["s_per_step"] = round(row["tokens_per_step"] / row["tokens_per_s"], 3)
        row["tflops_per_gpu"] = round(statistics.median(r["tflops"] for r in timed), 1)
        if all("mfu" in r for r in timed):
            row["mfu"] = round(statistics.median(r["mfu"] for r in timed), 4)
    losses = [r["loss"] for r in logs if "loss" in r]
    if losses:
        row["loss_first"], row["loss_last"] = round(losses[0], 4), round(losses[-1], 4)
    rows.append(row)
fields = []
for row in rows:
    fields += [k for k in row if k not in fields]
with open(csv_path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
print(f"\n{model}, {gpus} GPU(s), seq 4096 x batch 4 per GPU")
print(f"{'run':<6} {'rc':>4} {'ratio':>5} {'s/step':>7} {'tok/s':>8} {'TFLOPS':>7} {'alloc':>6} "
      f"{'resv':>6} {'smi':>6} {'plan':>6} {'host':>7}")
for r in rows:
    name = "liger" if r["use_liger_kernel"] else "plain"
    print(f"{name:<6} {r.get('returncode', '-'):>4} {r.get('ratio', '-'):>5} "
          f"{r.get('s_per_step', '-'):>7} {r.get('tokens_per_s', '-'):>8} "
          f"{r.get('tflops_per_gpu', '-'):>7} {r.get('gpu_alloc_peak_gib', '-'):>6} "
          f"{r.get('gpu_reserved_peak_gib', '-'):>6} {r.get('nvidia_smi_peak_gib', '-'):>6} "
          f"{r.get('plan_gpu_alloc_gib', '-'):>6} {r.get('host_peak_gib_all_ranks', '-'):>7}")
PY
tar -czf "$OUT/liger_logs.tgz" -C "$WORK" --exclude='runs_*' .
echo "liger_compare: done in $(($(date +%s) - BEGAN)) s"
