#!/usr/bin/env bash
# Long sequences on 2 GPUs with Ulysses sequence parallelism 2: Llama-3.1-8B (random weights
# from the shipped config, the bundled data filled into rows of the full length), one sequence
# a step, the length doubled from START until a system fails, for SuperOffload (the shipped
# accelerate_configs/x86x2_superoffload_sp2.yaml) and DeepSpeed ZeRO-Offload (the same config
# with accelerate_configs/deepspeed/zero3_offload.json and --optimizer adamw: DeepSpeed's CPU
# Adam), interleaved: each length runs on both before the next is tried. Both keep all
# optimizer state on the host (ratio 1.0, the shipped configs'), activation checkpointing on
# (the recipe's), sdpa attention.
#
#   bash dev/long_sequences.sh                       # repo root, 2 GPUs, `.whl` carried
#   SMOKE=1 DEADLINE_S=900 bash dev/long_sequences.sh  # a CPU check of the script: shrunken
#                                                    # model, CPU processes, lengths from 256
#
# Each length is a fresh launch under a time cap (the time left); a system stops at its first
# failure, recorded as "OOM (GPU)", "OOM (host)", "time" (its cap ran out) or "error", or at a
# length whose predicted time (start-up + STEPS x the last s/step, scaled by the FLOPs per
# token) exceeds the time left ("time (predicted)"). Per launch: start-up (to the first logged
# step), s/step (median of the steps after the first two, from when each step's log line was
# written), tokens/s, MFU per GPU (6 x matmul params + 12 x layers x hidden x sequence length
# per token, the recipes' count, against the GPU's dense bf16 peak), torch's allocated and
# reserved GPU peaks per rank (dev/gpu_peak_sitecustomize), nvidia-smi and host peaks of the
# process tree (dev/process_tree_peak.py).
#
# Env: OUT (default ./results), DEADLINE_S (default 570, inside a 600 s job), START (default
# 16384), MAX (default 1048576), STEPS (default 5), SYSTEMS (default "superoffload
# zerooffload"; each with the suffix _actoffload, e.g. superoffload_actoffload, runs the same
# with --activation_checkpoint_offload true: the checkpointed layer inputs in pinned host
# memory), HF_SUPEROFFLOAD_HOST_MEMORY_GIB (default 240: the H200 hosts' MemAvailable reads low
# at start).
# Writes $OUT/long_sequences.csv (a row per launch or skipped length) and
# $OUT/long_sequences_logs.tgz; prints a short table last.
set -u
BEGAN=$(date +%s)
SMOKE=${SMOKE:-0}
DEADLINE_S=${DEADLINE_S:-570}
STEPS=${STEPS:-5}
SYSTEMS=${SYSTEMS:-superoffload zerooffload}
OUT="${OUT:-results}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=/tmp/long_sequences
rm -rf "$WORK" && mkdir -p "$WORK"
RESERVE=20  # for the table, the tarball and the copies at the end
left() { echo $((DEADLINE_S - ($(date +%s) - BEGAN) - RESERVE)); }
note() { echo "[$(($(date +%s) - BEGAN)) s] $*" | tee -a "$WORK/run.log"; }

if [[ $SMOKE == 1 ]]; then
  START=${START:-256}
  MAX=${MAX:-512}
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  # The bundled rows are a few tokens each there (no filling): padded alike, so both ranks
  # hand Ulysses's loader batches of one shape.
  SCRIPT_EXTRA=(--shrink_model true --use_cpu true --bf16 false --pad_to_multiple_of 64)
else
  START=${START:-16384}
  MAX=${MAX:-1048576}
  source dev/gpu_env.sh > "$WORK/gpu_env.txt" 2>&1 || { cat "$WORK/gpu_env.txt"; exit 1; }
  head -1 "$WORK/gpu_env.txt"
  export HF_SUPEROFFLOAD_HOST_MEMORY_GIB=${HF_SUPEROFFLOAD_HOST_MEMORY_GIB:-240}
  SCRIPT_EXTRA=()
  find ~/.cache -name lock -delete 2>/dev/null
  # Both CPU Adams compile once per machine: before the first launch, side by side.
  python -c "import hf_superoffload.ops as o; o.prepare()" > "$WORK/build_ours.log" 2>&1 &
  b1=$!
  python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    > "$WORK/build_deepspeed.log" 2>&1 &
  b2=$!
  wait "$b1" "$b2"
  note "CPU Adams ready"
  {
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    echo "cores: $(nproc)"; free -g; uname -r
    if [[ -f COMMIT ]]; then echo "commit $(cat COMMIT)"; else git log -1 --format='commit %H %s' 2>/dev/null; fi
  } > "$WORK/env.txt" 2>&1
fi

# The accelerate configs: SuperOffload's as shipped, ZeRO-Offload's the same with DeepSpeed's
# plain CPU offload (the DeepSpeed file the recipes' zerooffload mode uses).
SP_CONFIG=accelerate_configs/x86x2_superoffload_sp2.yaml
python - "$SP_CONFIG" "$WORK/zerooffload_sp2.yaml" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
config["deepspeed_config"]["deepspeed_config_file"] = "accelerate_configs/deepspeed/zero3_offload.json"
yaml.safe_dump(config, open(sys.argv[2], "w"), sort_keys=False)
PY
# ZeRO-Offload is plain DeepSpeed: it reads none of the engine's HF_SUPEROFFLOAD_* variables
# (refused beside its config), so its launches run without them.
WITHOUT_ENGINE_VARIABLES=(env)
for v in $(python -c 'from hf_superoffload.zero3.config import ENGINE_VARIABLES as v; print(*v)'); do
  WITHOUT_ENGINE_VARIABLES+=(-u "$v")
done
declare -A CONFIG=([superoffload]=$SP_CONFIG [zerooffload]=$WORK/zerooffload_sp2.yaml)
declare -A OPTIMIZER=([superoffload]=superoffload [zerooffload]=adamw)
declare -A SYSTEM_ARGS=()
for base in superoffload zerooffload; do  # the same system, its layer inputs on the host
  CONFIG[${base}_actoffload]=${CONFIG[$base]}
  OPTIMIZER[${base}_actoffload]=${OPTIMIZER[$base]}
  SYSTEM_ARGS[${base}_actoffload]="--activation_checkpoint_offload true"
done
declare -A ALIVE LAST_STARTUP LAST_STEP LAST_LEN
for s in $SYSTEMS; do
  [[ -n "${CONFIG[$s]:-}" ]] || { echo "unknown system '$s'; known: ${!CONFIG[*]}"; exit 2; }
  ALIVE[$s]=1
done

end_leftovers() {  # a rank a time cap left behind holds GPU memory the next launch needs
  local pids
  pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [[ -n "$pids" ]] && { note "ending leftover GPU processes: $pids"; kill -9 $pids 2>/dev/null; sleep 3; }
}

# predicted SYSTEM LEN: seconds for a launch at LEN from the last one (start-up + STEPS x the
# last s/step x the growth of a step's FLOPs), or nothing when there is no last one.
predicted() {
  local sys=$1 len=$2
  [[ -n "${LAST_STEP[$sys]:-}" ]] || return 0
  python -c "
import sys
startup, step, last, new, steps = map(float, sys.argv[1:])
per_token = lambda n: 6 * 7.5e9 + 12 * 32 * 4096 * n  # Llama-3.1-8B's matmul params, layers, hidden
print(int(startup + steps * step * (new / last) * per_token(new) / per_token(last)))
" "${LAST_STARTUP[$sys]}" "${LAST_STEP[$sys]}" "${LAST_LEN[$sys]}" "$len" "$STEPS"
}

# The row a launch leaves: WORK/<sys>_<len>/row.json (read by the summary at the end).
skip_row() {  # sys len status
  mkdir -p "$WORK/$1_$2"
  printf '{"system": "%s", "seq": %s, "status": "%s"}\n' "$1" "$2" "$3" > "$WORK/$1_$2/row.json"
  note "$1 at $2: $3"
}

launch() {  # sys len cap
  local sys=$1 len=$2 cap=$3 dir=$WORK/$1_$2
  mkdir -p "$dir"
  local cmd=(accelerate launch --config_file "${CONFIG[$sys]}" examples/sft.py
    --config examples/recipes/llama-3.1-8b.yaml --random_init_from_config llama-3.1-8b
    --dataset_path examples/data/arithmetic_sft.jsonl --sequence_parallel_size 2
    --max_length "$len" --per_device_train_batch_size 1 --gradient_accumulation_steps 1
    --max_steps "$STEPS" --logging_steps 1 --save_strategy no --save_model false
    --require_loss_decrease false --loss_plot false --disable_tqdm true
    --optimizer "${OPTIMIZER[$sys]}" --output_dir "$dir/output" ${SYSTEM_ARGS[$sys]:-}
    ${SCRIPT_EXTRA[@]+"${SCRIPT_EXTRA[@]}"})
  [[ ${OPTIMIZER[$sys]} == adamw ]] && cmd=("${WITHOUT_ENGINE_VARIABLES[@]}" "${cmd[@]}")
  printf '%q ' "${cmd[@]}" > "$dir/command.txt"
  note "$sys at $len: up to $cap s"
  # Each logged step's arrival time: the trainer appends a line to log_history.jsonl per step.
  python - "$dir/output/log_history.jsonl" "$dir/step_times.txt" <<'PY' &
import os, sys, time
path, out = sys.argv[1], sys.argv[2]
seen = 0
began = time.time()
with open(out, "w") as f:
    f.write(f"start {began:.3f}\n")
    while True:
        try:
            with open(path) as log:
                lines = log.read().count("\n")
        except OSError:
            lines = 0
        for i in range(seen, lines):
            f.write(f"line {i + 1} {time.time():.3f}\n")
            f.flush()
        seen = max(seen, lines)
        time.sleep(0.1)
PY
  local watcher=$!
  GPU_PEAK_DIR="$dir/gpu_peak" PYTHONPATH="$PWD/dev/gpu_peak_sitecustomize:${PYTHONPATH:-}" \
    timeout -k 20 "$cap" python dev/process_tree_peak.py "$dir/peak.json" -- "${cmd[@]}" \
    > "$dir/train.log" 2>&1
  local rc=$?
  sleep 0.5
  kill "$watcher" 2>/dev/null
  wait "$watcher" 2>/dev/null
  [[ $SMOKE == 1 ]] || end_leftovers
  (dmesg 2>/dev/null | grep -iE 'out of memory|oom-kill|killed process' | tail -5) > "$dir/dmesg.txt"
  python - "$dir" "$sys" "$len" "$rc" "$cap" "$STEPS" <<'PY'
import json, os, re, statistics, sys
d, system, seq, rc, cap, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
row = {"system": system, "seq": seq, "returncode": rc, "cap_s": cap}
times = {}
start = None
for line in open(f"{d}/step_times.txt"):
    parts = line.split()
    if parts[0] == "start":
        start = float(parts[1])
    else:
        times[int(parts[1])] = float(parts[2])
logs = []
if os.path.exists(f"{d}/output/log_history.jsonl"):
    logs = [json.loads(x) for x in open(f"{d}/output/log_history.jsonl")]
stepped = [(i + 1, r) for i, r in enumerate(logs) if "loss" in r and "train_runtime" not in r]
row["steps_done"] = len(stepped)
if stepped:
    first_line = stepped[0][0]
    if first_line in times and start is not None:  # launch to the first step's log
        row["startup_s"] = round(times[first_line] - start, 1)
    row["loss_first"], row["loss_last"] = round(stepped[0][1]["loss"], 4), round(stepped[-1][1]["loss"], 4)
    seen = [line for line, _ in stepped if line in times]
    gaps = [times[b] - times[a] for a, b in zip(seen, seen[1:])][1:]  # steps 3..
    if gaps:
        row["s_per_step"] = round(statistics.median(gaps), 2)
    tokens = [r.get("num_tokens") for _, r in stepped]
    if all(t is not None for t in tokens) and len(tokens) > 1:
        row["tokens_per_step"] = statistics.median(b - a for a, b in zip(tokens, tokens[1:]))
    logged = [r["tflops"] for _, r in stepped[2:] if "tflops" in r]
    if logged:
        row["tflops_logged"] = round(statistics.median(logged), 1)
peak = {}
if os.path.exists(f"{d}/peak.json"):
    peak = json.load(open(f"{d}/peak.json"))
    row["host_peak_gib"] = peak["anon_shmem_gib"]
    row["nvidia_smi_peak_gib"] = max(peak["gpu_used_gib"] or [0])
ranks = []
if os.path.isdir(f"{d}/gpu_peak"):
    ranks = [json.load(open(f"{d}/gpu_peak/{n}")) for n in os.listdir(f"{d}/gpu_peak")]
if ranks:
    row["gpu_alloc_peak_gib"] = round(max(r["max_allocated_bytes"] for r in ranks) / 2**30, 2)
    row["gpu_reserved_peak_gib"] = round(max(r["max_reserved_bytes"] for r in ranks) / 2**30, 2)
text = open(f"{d}/train.log", errors="replace").read()
dmesg = open(f"{d}/dmesg.txt").read()
if row["steps_done"] >= steps and rc == 0:
    row["status"] = "ok"
elif re.search(r"CUDA out of memory|OutOfMemoryError: CUDA|torch.OutOfMemoryError", text):
    row["status"] = "OOM (GPU)"
elif re.search(r"HostMemoryError|Cannot allocate memory", text) or (rc in (137, -9) and dmesg):
    row["status"] = "OOM (host)"
elif rc in (124, 137) or rc < 0:
    row["status"] = f"time (cap {cap} s, {row['steps_done']} steps done)"
else:
    errors = [l.strip() for l in text.splitlines()
              if re.search(r"\w+(Error|Exception): ", l) and "ChildFailedError" not in l]
    row["status"] = "error: " + (errors[-1][:160] if errors else f"exit code {rc}")
json.dump(row, open(f"{d}/row.json", "w"))
print(json.dumps({k: row.get(k) for k in ("status", "steps_done", "startup_s", "s_per_step", "gpu_alloc_peak_gib", "host_peak_gib")}))
PY
}

len=$START
while ((len <= MAX)); do
  for sys in $SYSTEMS; do
    ((ALIVE[$sys])) || continue
    budget=$(left)
    guess=$(predicted "$sys" "$len")
    if [[ -n "$guess" ]] && ((guess > budget)); then
      skip_row "$sys" "$len" "time (predicted): about $guess s for $STEPS steps, $budget s left"
      ALIVE[$sys]=0
      continue
    fi
    if ((budget < 60)); then
      skip_row "$sys" "$len" "time: $budget s left"
      ALIVE[$sys]=0
      continue
    fi
    launch "$sys" "$len" "$budget" | tee -a "$WORK/run.log"
    status=$(python -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["status"], r.get("startup_s",""), r.get("s_per_step",""))' "$WORK/${sys}_$len/row.json")
    read -r first startup step <<< "$status"
    if [[ $first == ok && -n "$step" ]]; then
      LAST_STARTUP[$sys]=$startup LAST_STEP[$sys]=$step LAST_LEN[$sys]=$len
    else
      ALIVE[$sys]=0
    fi
  done
  any=0
  for sys in $SYSTEMS; do ((ALIVE[$sys])) && any=1; done
  ((any)) || break
  len=$((len * 2))
done

# The table: one row per launch or skipped length, MFU by the recipes' count.
python - "$WORK" "$OUT/long_sequences.csv" "$SMOKE" <<'PY'
import csv, glob, json, os, sys, time
work, csv_path, smoke = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
rows = [json.load(open(p)) for p in glob.glob(f"{work}/*/row.json")]
rows.sort(key=lambda r: (r["seq"], r["system"] != "superoffload"))
peak = None
matmul = None
if not smoke:
    import torch
    import transformers
    from hf_superoffload.cli.model_source import resolve
    from hf_superoffload.integrations.metrics import matmul_params, peak_tflops

    config = resolve("llama-3.1-8b").config
    with torch.device("meta"):
        matmul = matmul_params(transformers.AutoModelForCausalLM.from_config(config))
    peak = peak_tflops()
    gpu = torch.cuda.get_device_name(0)
for r in rows:
    r["date"] = time.strftime("%Y-%m-%d")
    r["model"] = "llama-3.1-8b"
    r["sequence_parallel"] = 2
    if r.get("s_per_step") and matmul:
        attention = 12 * config.num_hidden_layers * config.hidden_size * r["seq"]
        flops = r["seq"] * (6 * matmul + attention)  # one sequence a step
        r["tokens_per_s"] = round(r["seq"] / r["s_per_step"], 1)
        r["tflops_per_gpu"] = round(flops / r["s_per_step"] / 2 / 1e12, 1)
        r["mfu"] = round(r["tflops_per_gpu"] / peak, 4) if peak else None
        r["gpu"] = gpu
fields = ["date", "model", "system", "seq", "sequence_parallel", "status", "steps_done",
          "startup_s", "s_per_step", "tokens_per_step", "tokens_per_s", "tflops_per_gpu",
          "tflops_logged", "mfu", "gpu_alloc_peak_gib", "gpu_reserved_peak_gib",
          "nvidia_smi_peak_gib", "host_peak_gib", "loss_first", "loss_last", "returncode",
          "cap_s", "gpu"]
with open(csv_path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
print(f"\nLlama-3.1-8B, Ulysses over 2 GPUs, one sequence a step{' (SMOKE: CPU)' if smoke else ''}")
print(f"{'system':<23} {'seq':>8} {'s/step':>7} {'tok/s':>8} {'MFU':>6} {'alloc':>6} {'smi':>6} {'host':>6}  status")
for r in rows:
    print(f"{r['system']:<23} {r['seq']:>8} {r.get('s_per_step') or '-':>7} {r.get('tokens_per_s') or '-':>8} "
          f"{r.get('mfu') or '-':>6} {r.get('gpu_alloc_peak_gib') or '-':>6} "
          f"{r.get('nvidia_smi_peak_gib') or '-':>6} {r.get('host_peak_gib') or '-':>6}  {r['status']}")
PY
tar -czf "$OUT/long_sequences_logs.tgz" -C "$WORK" --exclude='output' .
note "done"
