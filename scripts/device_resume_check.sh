#!/usr/bin/env bash
# Llama-3.1-8B (random weights) through the recipe launcher on one GPU: 6 steps uninterrupted,
# against 3 steps, a checkpoint, a stop, and a resume for the 3 more; the same seed and schedule.
# Prints the per-step loss and grad norm of both runs and each run's host and GPU peaks beside
# the memory plan (training and resume) for an H100 with a 128 GiB host.
#
#   bash scripts/device_resume_check.sh      # repo root, >= 2 GPUs, `.whl` carried, >= 130 GB disk
#
# Two GPUs let the uninterrupted run go beside the checkpointed one. The 8B checkpoint (fp32
# master and both moments: 12 B/param, plus the 16-bit model) is about 112 GB, more than the
# disk of a one-GPU machine here; the host peaks are per process tree, so they are what one
# H100 host would see. Env: RATIO (default: auto, planned for PLAN_HARDWARE), PLAN_HARDWARE
# (default "--gpu-mem 80 --cpu-mem 128"), OUT (default ./results), SCRATCH (default /tmp/resume).
set -u
OUT="${OUT:-results}"
SCRATCH="${SCRATCH:-/tmp/resume}"
mkdir -p "$OUT" "$SCRATCH"
source scripts/device_env.sh || exit 1
find ~/.cache -name lock -delete 2>/dev/null
export RANDOM_INIT=1 RATIO="${RATIO:-auto}" PLAN_HARDWARE="${PLAN_HARDWARE:---gpu-mem 80 --cpu-mem 128}"
export SUPEROFFLOAD_CPU_THREADS=14  # two runs share this host's cores
STEPS=(--max_steps 6 --logging_steps 1 --save_strategy no --require_loss_decrease false)
start=$(date +%s)
df -h "$SCRATCH" /dev/shm | tail -2
python -c "import hf_superoffload.ops as o; o.prepare()" > "$OUT/build_ours.log" 2>&1

# The uninterrupted run's final model goes to memory, beside the checkpoint on disk.
runs_dir() { if [ "$1" = whole ]; then echo /dev/shm/resume/whole; else echo "$SCRATCH/$1"; fi; }
# prepare RUN: the launcher writes the run directory (plan, configs, command) without launching;
# each run gets its own rendezvous port so two can run at once.
prepare() {
  local name=$1; shift
  DRY_RUN=1 RUNS_DIR="$(runs_dir "$name")" bash examples/finetune_llama-3.1-8b.sh superoffload 4 "$@" \
    > "$OUT/$name.prepare.log" 2>&1 || { cat "$OUT/$name.prepare.log"; return 1; }
  local dir; dir=$(ls -d "$(runs_dir "$name")"/*/)
  echo "main_process_port: 0" >> "$dir/accelerate.yaml"
  echo "$dir"
}
# launch NAME GPU: run the prepared command under the peak sampler.
launch() {
  local dir; dir=$(ls -d "$(runs_dir "$1")"/*/)
  CUDA_VISIBLE_DEVICES=$2 timeout "${3:-3000}" python scripts/process_tree_peak.py "$OUT/$1.peak.json" -- \
    bash "$dir/command.sh" > "$OUT/$1.log" 2>&1
}

python -m hf_superoffload plan llama-3.1-8b --gpus 1 $PLAN_HARDWARE --ratio "$RATIO" \
  > "$OUT/plan.txt" 2>&1
prepare whole "${STEPS[@]}" > /dev/null || exit 1
# The ratio auto planned, for the other two runs (one plan, not three).
RATIO=$(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["zero_optimization"]["offload_optimizer"]["ratio"])' /dev/shm/resume/whole/*/deepspeed.json)
echo "ratio $RATIO"
prepare first --max_steps 6 --logging_steps 1 --save_strategy steps --save_steps 3 --require_loss_decrease false > /dev/null || exit 1
launch whole 1 &
WHOLE=$!
launch first 0 &
FIRST=$!
# The checkpointed run stops once its step-3 checkpoint is complete (trainer_state.json is
# written last), as a job ended by its scheduler would.
deadline=$(( $(date +%s) + 420 ))
until ls "$SCRATCH"/first/*/output/checkpoint-3/trainer_state.json > /dev/null 2>&1; do
  if ! kill -0 $FIRST 2>/dev/null || (( $(date +%s) > deadline )); then
    echo "no complete checkpoint-3 (see $OUT/first.log)"; tail -20 "$OUT/first.log"; break
  fi
  sleep 2
done
kill -TERM $FIRST 2>/dev/null; wait $FIRST
CKPT=$(ls -d "$SCRATCH"/first/*/output/checkpoint-3 2>/dev/null)
du -sh "$CKPT" > "$OUT/checkpoint_size.txt" 2>&1
wait $WHOLE
rm -rf /dev/shm/resume/whole/*/output/model*.safetensors
prepare resumed "${STEPS[@]}" --resume_from_checkpoint "$CKPT" > /dev/null || exit 1
launch resumed 0 $(( 580 - ($(date +%s) - start) ))

python - "$SCRATCH" "$OUT" <<'PY'
import glob, json, sys
scratch, out = sys.argv[1:]
def history(name):
    where = "/dev/shm/resume" if name == "whole" else scratch
    path = glob.glob(f"{where}/{name}/*/output/trainer_state.json")
    logs = json.load(open(path[0]))["log_history"] if path else []
    return {r["step"]: r for r in logs if "loss" in r}
whole, resumed = history("whole"), history("resumed")
print(f"{'step':>4} {'loss whole':>11} {'loss resumed':>12} {'gnorm whole':>11} {'gnorm resumed':>13}")
for step in range(1, 7):
    w, r = whole.get(step, {}), resumed.get(step, {})
    f = lambda d, k: f"{d[k]:.6f}" if k in d else "-"
    print(f"{step:>4} {f(w,'loss'):>11} {f(r,'loss'):>12} {f(w,'grad_norm'):>11} {f(r,'grad_norm'):>13}")
for name in ("whole", "first", "resumed"):
    try:
        p = json.load(open(f"{out}/{name}.peak.json"))
    except OSError:
        continue
    print(f"{name:>8}: host anon+shmem {p['anon_shmem_gib']} GiB, file-backed {p['file_gib']} GiB,"
          f" GPU {p['gpu_used_gib']} GiB, rc {p['returncode']}")
PY
grep -iE "ratio|GiB|resume" "$OUT/plan.txt" | head -20
cat "$OUT/checkpoint_size.txt"
echo "done in $(( $(date +%s) - start )) s"
