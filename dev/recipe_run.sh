#!/usr/bin/env bash
# A paper model through the recipe launcher (`hf-superoffload finetune`) with random weights,
# seq 4096 and batch 4 per GPU, a few steps, no model saved; then DeepSpeed ZeRO-Offload through
# the same launcher in the time left. Per run: s/step, tokens/s and TFLOPS per GPU (the
# trainer's own log, steps after the first two), GPU and host peaks (process tree), host bytes
# per param, torch's allocated GPU peak per rank (dev/gpu_peak_sitecustomize), and the memory
# plan's prediction. The summary lines also go to $OUT/summary.txt, and $OUT/recipe_logs.tgz
# holds them with each run's log, log history, plan and host and per-rank GPU peaks.
#
#   bash dev/recipe_run.sh qwen3-30b-a3b 4 [steps]     # repo root, `.whl` carried
#
# Env: OUT (default ./results), DEADLINE_S (default 570), MODES (default "superoffload zerooffload"),
# EXTRA (script arguments for the superoffload mode only, e.g. "--superoffload_moments compact":
# zerooffload runs --optimizer adamw, which refuses superoffload_* arguments; it runs without
# the engine's HF_SUPEROFFLOAD_* variables too),
# PLAN (finetune's options for the superoffload mode's RATIO=auto plan, e.g. "--cpu-mem 500":
# the device hosts' MemTotal reads low until their memory is used).
set -u
MODEL=${1:?model}
GPUS=${2:?gpus}
STEPS=${3:-10}
OUT="${OUT:-results}"
DEADLINE_S=${DEADLINE_S:-570}
MODES=${MODES:-superoffload zerooffload}
EXTRA=${EXTRA:-}
PLAN=${PLAN:-}
BEGAN=$(date +%s)
mkdir -p "$OUT"
source dev/gpu_env.sh || exit 1
find ~/.cache -name lock -delete 2>/dev/null
python -c "import hf_superoffload.ops as o; o.prepare()" > "$OUT/build_ours.log" 2>&1
# zerooffload, the baseline, is plain DeepSpeed: it reads none of the engine's HF_SUPEROFFLOAD_*
# variables (the launcher refuses them beside its config), so it runs without them.
WITHOUT_ENGINE_VARIABLES=(env)
for v in $(python -c 'from hf_superoffload.zero3.config import ENGINE_VARIABLES as v; print(*v)'); do
  WITHOUT_ENGINE_VARIABLES+=(-u "$v")
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
free -g | head -2

for mode in $MODES; do
  left=$((DEADLINE_S - ($(date +%s) - BEGAN) - 20))
  ((left > 60)) || { echo "$mode: skipped, ${left} s left"; continue; }
  runs=/tmp/recipe_runs/$mode
  rm -rf "$runs"
  plain=()
  [ "$mode" = zerooffload ] && plain=("${WITHOUT_ENGINE_VARIABLES[@]}")
  ${plain[@]+"${plain[@]}"} python -m hf_superoffload finetune "$MODEL" "$mode" --gpus "$GPUS" --random-init \
    --runs-dir "$runs" --dry-run $([ "$mode" = superoffload ] && echo "$PLAN") -- --max_steps "$STEPS" --logging_steps 1 \
    --save_strategy no --save_model false --require_loss_decrease false \
    $([ "$mode" = superoffload ] && echo "$EXTRA") > "$OUT/$mode.prepare.log" 2>&1 || { cat "$OUT/$mode.prepare.log"; continue; }
  dir=$(ls -d "$runs"/*/)
  cp "$dir"/plan.json "$OUT/$mode.plan.json" 2>/dev/null
  echo "$mode: $(cat "$dir/command.sh" | tail -1 | cut -c1-200) (limit ${left} s)"
  rm -rf "$OUT/$mode.gpu_peak"
  TRAIN_LOG="$dir/output/log_history.jsonl" GPU_PEAK_DIR="$OUT/$mode.gpu_peak" \
    PYTHONPATH="$PWD/dev/gpu_peak_sitecustomize:${PYTHONPATH:-}" \
    ${plain[@]+"${plain[@]}"} timeout "$left" python dev/process_tree_peak.py "$OUT/$mode.peak.json" -- bash "$dir/command.sh" \
    > "$OUT/$mode.log" 2>&1
  echo "$mode: rc $? after $(($(date +%s) - BEGAN)) s"
  cp "$dir"/output/log_history.jsonl "$OUT/$mode.log_history.jsonl" 2>/dev/null
  grep -E "Error|error:|Killed|out of memory" "$OUT/$mode.log" | tail -3
done
dmesg 2>/dev/null | grep -iE "killed process|out of memory" | tail -3 > "$OUT/dmesg.txt"

python - "$OUT" "$MODEL" "$GPUS" > "$OUT/summary.txt" <<'PY'
import glob, json, os, statistics, sys
out, model, gpus = sys.argv[1], sys.argv[2], int(sys.argv[3])
gib = 2**30
for mode in ("superoffload", "zerooffload"):
    try:
        peak = json.load(open(f"{out}/{mode}.peak.json"))
    except OSError:
        continue
    rows = []
    if os.path.exists(f"{out}/{mode}.log_history.jsonl"):
        rows = [json.loads(x) for x in open(f"{out}/{mode}.log_history.jsonl")]
    steps = [r for r in rows if "tokens_per_second" in r and r["step"] > 2]
    line = f"{mode}: rc {peak['returncode']}, host peak {peak['anon_shmem_gib']} GiB (all ranks)"
    if "train_end_s" in peak:
        line += f" ({peak['train_anon_shmem_gib']} until training ended at {peak['train_end_s']} s)"
    line += f", GPU {peak['gpu_used_gib']} GiB (nvidia-smi)"
    allocated = sorted(
        (int(r["rank"] or 0), r["max_allocated_bytes"] / gib)
        for r in map(lambda f: json.load(open(f)), glob.glob(f"{out}/{mode}.gpu_peak/*.json"))
    )
    if allocated:
        line += f", torch allocated peak per rank {[round(a, 2) for _, a in allocated]} GiB"
    if steps:
        tps = statistics.median(r["tokens_per_second"] for r in steps)
        tflops = statistics.median(r["tflops"] for r in steps)
        tokens = statistics.median(
            b["num_tokens"] - a["num_tokens"] for a, b in zip(steps, steps[1:])
        ) if len(steps) > 1 else None
        sps = tokens / tps if tokens else None
        line += f", {len(steps)} steps after 2: {tps:,.0f} tokens/s, {tflops:.0f} TFLOPS/GPU"
        line += f", {sps:.2f} s/step" if sps else ""
        line += f", tokens/step {tokens:.0f}" if tokens else ""
    try:
        plan = json.load(open(f"{out}/{mode}.plan.json"))
        params = plan["model"]["params"]
        line += (f"; plan: ratio {plan['run']['ratio']}, GPU {plan['gpu_total_bytes'] / gib:.1f} GiB/rank,"
                 f" host {plan['host_training_bytes_per_rank'] / gib:.1f} GiB/rank;"
                 f" measured host {peak['anon_shmem_gib'] * gib / params:.1f} B/param")
    except (OSError, KeyError):
        pass
    print(line)
PY
cat "$OUT/summary.txt"
# The per-rank GPU peaks (each mode's .gpu_peak folder) go in too: the summary's allocated figures.
tar -czf "$OUT/recipe_logs.tgz" -C "$OUT" $(cd "$OUT" && ls -d *.log *.json *.jsonl *.txt *.gpu_peak 2>/dev/null)
echo "done in $(($(date +%s) - BEGAN)) s"
