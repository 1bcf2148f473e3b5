#!/usr/bin/env bash
# Llama-3.1-8B (random weights) through the recipe launcher on one GPU: 6 steps with a checkpoint
# at step 3, against a resume from that checkpoint for steps 4-6 in a fresh process on the same
# GPU; an uninterrupted run without checkpoints on a second GPU shows the run-to-run spread.
# Prints each run's host and GPU peaks beside the memory plan (training, save and resume) for an
# H100 with a 128 GiB host, then, last, the per-step loss and grad norm at full precision
# (each run's log_history.jsonl).
#
#   bash dev/resume_check.sh      # repo root, >= 2 GPUs, `.whl` carried, >= 130 GB disk
#
# The 8B checkpoint (fp32 master and both moments: 12 B/param, plus the 16-bit model) is about
# 105 GiB, more than the disk of a one-GPU machine here; the host peaks are per process tree, so
# they are what one H100 host would see. Env: RATIO (default: auto, planned for PLAN_HARDWARE),
# PLAN_HARDWARE (default "--gpu-mem 80 --cpu-mem 128"), OUT (default ./results), SCRATCH
# (default /tmp/resume).
set -u
OUT="${OUT:-results}"
SCRATCH="${SCRATCH:-/tmp/resume}"
mkdir -p "$OUT" "$SCRATCH"
source dev/gpu_env.sh || exit 1
find ~/.cache -name lock -delete 2>/dev/null
export RANDOM_INIT=1 RATIO="${RATIO:-auto}" PLAN_HARDWARE="${PLAN_HARDWARE:---gpu-mem 80 --cpu-mem 128}"
export HF_SUPEROFFLOAD_CPU_THREADS=14  # two runs share this host's cores
STEPS=(--max_steps 6 --logging_steps 1 --save_strategy no --save_model false --require_loss_decrease false)
start=$(date +%s)
df -h "$SCRATCH" /dev/shm | tail -2
python -c "import hf_superoffload.ops as o; o.prepare()" > "$OUT/build_ours.log" 2>&1

runs_dir() { echo "$SCRATCH/$1"; }
# prepare RUN: the launcher writes the run directory (plan, configs, command) without launching;
# each run gets its own rendezvous port so two can run at once.
prepare() {
  local name=$1; shift
  DRY_RUN=1 RUNS_DIR="$(runs_dir "$name")" bash examples/finetune_llama-3.1-8b.sh superoffload 4 "$@" \
    > "$OUT/$name.prepare.log" 2>&1 || { cat "$OUT/$name.prepare.log"; return 1; }
  local dir; dir=$(ls -d "$(runs_dir "$name")"/*/)
  echo "main_process_port: 0" >> "$dir/accelerate.yaml"
  # HF_SUPEROFFLOAD_CPU_THREADS sizes each run's CPU Adam (two share the host): the config's
  # cpuadam_cores_perc, refused beside it, goes.
  python -c 'import json, sys; c = json.load(open(sys.argv[1])); c["zero_optimization"]["offload_optimizer"].pop("cpuadam_cores_perc", None); json.dump(c, open(sys.argv[1], "w"), indent=2)' "$dir/deepspeed.json"
  echo "$dir"
}
# launch NAME GPU: run the prepared command under the peak sampler.
launch() {
  local dir; dir=$(ls -d "$(runs_dir "$1")"/*/)
  CUDA_VISIBLE_DEVICES=$2 timeout "${3:-3000}" python dev/process_tree_peak.py "$OUT/$1.peak.json" -- \
    bash "$dir/command.sh" > "$OUT/$1.log" 2>&1
}

python -m hf_superoffload plan llama-3.1-8b --gpus 1 $PLAN_HARDWARE --ratio "$RATIO" \
  > "$OUT/plan.txt" 2>&1
prepare whole "${STEPS[@]}" > /dev/null || exit 1
# The ratio auto planned, for the other two runs (one plan, not three).
RATIO=$(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["zero_optimization"]["offload_optimizer"]["ratio"])' "$SCRATCH"/whole/*/deepspeed.json)
echo "ratio $RATIO"
prepare first --max_steps 6 --logging_steps 1 --save_strategy steps --save_steps 3 --save_model false \
  --require_loss_decrease false > /dev/null || exit 1
launch whole 1 &
WHOLE=$!
launch first 0 &
FIRST=$!
# The checkpointed run goes on to step 6 (the same-GPU reference for the resumed steps) and is
# stopped once step 6 is logged: its step-6 checkpoint would not fit beside the step-3 one.
logged6() { grep -qsE '"step": 6, .*"grad_norm"' "$SCRATCH"/first/*/output/log_history.jsonl; }
deadline=$(( $(date +%s) + 450 ))
until logged6; do
  if ! kill -0 $FIRST 2>/dev/null || (( $(date +%s) > deadline )); then
    echo "the checkpointed run did not log step 6 (see $OUT/first.log)"; tail -20 "$OUT/first.log"; break
  fi
  sleep 1
done
pkill -TERM -P $FIRST 2>/dev/null; kill -TERM $FIRST 2>/dev/null; wait $FIRST
rm -rf "$SCRATCH"/first/*/output/checkpoint-6
CKPT=$(ls -d "$SCRATCH"/first/*/output/checkpoint-3 2>/dev/null)
ls "$CKPT/trainer_state.json" > /dev/null || exit 1
du -sh "$CKPT" > "$OUT/checkpoint_size.txt" 2>&1
wait $WHOLE
prepare resumed "${STEPS[@]}" --resume_from_checkpoint "$CKPT" > /dev/null || exit 1
launch resumed 0 $(( 580 - ($(date +%s) - start) ))

for name in whole first resumed; do cp "$SCRATCH"/$name/*/output/log_history.jsonl "$OUT/$name.log_history.jsonl"; done
grep -iE "ratio|GiB|resume" "$OUT/plan.txt" | head -20
cat "$OUT/checkpoint_size.txt"
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def history(name):
    try:
        lines = [json.loads(x) for x in open(f"{out}/{name}.log_history.jsonl")]
    except OSError:
        return {}
    return {r["step"]: r for r in lines if "loss" in r}  # a resumed run's last line per step
for name in ("whole", "first", "resumed"):
    try:
        p = json.load(open(f"{out}/{name}.peak.json"))
    except OSError:
        continue
    print(f"{name:>8}: host anon+shmem {p['anon_shmem_gib']} GiB, file-backed {p['file_gib']} GiB,"
          f" GPU {p['gpu_used_gib']} GiB, rc {p['returncode']}")
    if name == "resumed":  # the load's window: file-backed pages above 1.5 GiB
        load = [t for t in p["timeline"] if t[2] > 1.5]
        if load:
            print(f"  resume window {load[0][0]}-{load[-1][0]} s: anon+shmem up to "
                  f"{max(t[1] for t in load)} GiB, with file-backed {max(t[2] for t in load)} GiB;"
                  f" anon+shmem + file-backed up to {max(t[1] + t[2] for t in load):.2f} GiB")
whole, first, resumed = history("whole"), history("first"), history("resumed")
print("step  run              loss              grad_norm         (full precision)")
for step in range(1, 7):
    for name, runs in (("first (GPU 0)", first), ("resumed (GPU 0)", resumed), ("whole (GPU 1)", whole)):
        r = runs.get(step)
        if r and not (name.startswith("resumed") and step <= 3):
            print(f"{step:>4}  {name:<16} {r['loss']!r:<17} {r.get('grad_norm')!r}")
same = [s for s in (4, 5, 6) if s in first and s in resumed
        and (first[s]["loss"], first[s].get("grad_norm")) == (resumed[s]["loss"], resumed[s].get("grad_norm"))]
print(f"resumed steps bit-equal to the checkpointed run's own steps 4-6: {same}")
PY
tar -czf "$OUT/resume_logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.json *.jsonl *.txt 2>/dev/null) && \
  (cd "$OUT" && rm -f *.log *.json)
echo "done in $(( $(date +%s) - start )) s"
