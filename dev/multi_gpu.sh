#!/usr/bin/env bash
# The multi-GPU checks of the ZeRO-3 path. Several stages run in one command, in the order
# given, inside one time budget:
#
#   bash dev/multi_gpu.sh scaling scaling-noclip qwen3-30b-a3b qwen3-30b-a3b-deepspeed
#
# Stages:
#   tests                multi_gpu tests: ZeRO-3 vs DeepSpeed, Ulysses, failure watch
#   scaling              3.37B, clip 1.0: ZeRO-3 SuperOffload on GPUS GPUs, then on 1 GPU of the
#                        same host (tokens/s per GPU, target >= 0.95 of one GPU's)
#   scaling-noclip       3.37B, no clipping: DDP without offload, then ZeRO-3 SuperOffload, both
#                        on GPUS GPUs
#   scaling-zero3        3.37B, clip 1.0: DeepSpeed ZeRO-3 without offload on GPUS GPUs, then on
#                        1 GPU (what ZeRO-3's own communication leaves of one GPU's tokens/s;
#                        one GPU holds all of its optimizer state, about 16 B/param)
#   qwen3-14b            the 2-GPU model: ZeRO-3 SuperOffload at the memory plan's ratio
#   qwen3-30b-a3b        the 4-GPU MoE model, the same
#   <model>-deepspeed    DeepSpeed ZeRO-Offload (all optimizer state on the host) at that size
#
# Environment:
#   GPUS=N          GPUs of the scaling stages (default: all this machine has)
#   DEADLINE_S=S    seconds the whole command may take (default 570, inside a 600 s job
#                   limit): each system gets what is left, up to its stage's cap, and a stage
#                   that cannot get its minimum is skipped and listed as such
#   HOST_MEM_GIB=M  host memory the plan assumes (default 128 per GPU, as the H200 and H100
#                   hosts have; their MemTotal starts low and grows with use, so it is not read)
#   RATIO=R         the model stages' offload_optimizer.ratio (default: `plan --ratio auto`)
#
# Run from the repo root on a machine with >= 2 GPUs, `.whl` carried (dev/gpu_env.sh).
# Writes under $OUT (default ./results): run.log, suite.csv (a row per system), logs.tgz (each
# system's log), plan_<model>.txt/.json, env.txt, dmesg.txt; prints a short table last.
set -u
(($# > 0)) || { sed -n '2,/^set -u/p' "$0" | head -n -1 >&2; exit 2; }
BEGAN=$(date +%s)
DEADLINE_S=${DEADLINE_S:-570}
OUT="${OUT:-results}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
WORK=${WORK:-/tmp/multi_gpu}  # the suite's own tree (plots, nested logs); $OUT gets copies
mkdir -p "$WORK"
RESERVE=25                    # for the table, the copies and dmesg at the end
SKIPPED=()

left() { echo $((DEADLINE_S - ($(date +%s) - BEGAN) - RESERVE)); }
note() { echo "[$(($(date +%s) - BEGAN)) s] $*"; }

source dev/gpu_env.sh || exit 1
if ! command -v python >/dev/null; then  # the image may name its interpreter python3 only
  mkdir -p /tmp/python_shim && ln -sf "$(command -v python3)" /tmp/python_shim/python
  export PATH="/tmp/python_shim:$PATH"
fi
find ~/.cache -name lock -delete 2>/dev/null
FOUND=$(python -c 'import torch; print(torch.cuda.device_count())')
GPUS=${GPUS:-$FOUND}
GPU_MEM=${GPU_MEM_GIB:-$(python -c 'import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2**30))')}
HOST_MEM_GIB=${HOST_MEM_GIB:-$((128 * FOUND))}
{
  date -u +%FT%TZ
  # A copy of the tree without its .git names its commit in a COMMIT file.
  if [[ -f COMMIT ]]; then echo "commit $(cat COMMIT)"; else git log -1 --format='commit %H %s'; fi
  # A copy of a working tree keeps the checkout's last commit: say when its files differ.
  git diff --quiet HEAD 2>/dev/null || echo "the files differ from that commit: $(git diff --stat HEAD | tail -1)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  echo "cores: $(nproc)"; free -g; uname -r
  python -c 'import torch, transformers, deepspeed; print("torch", torch.__version__, "| transformers", transformers.__version__, "| deepspeed", deepspeed.__version__, "| nccl", torch.cuda.nccl.version())'
} > "$OUT/env.txt" 2>&1
note "$FOUND GPUs of $GPU_MEM GiB, host planned as $HOST_MEM_GIB GiB; stages: $*"

# Any GPU process a system left behind holds memory the next one needs: end it, by its pid
# (on a dedicated GPU machine every GPU process is this command's).
end_leftovers() {
  local pids
  pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  if [[ -n "$pids" ]]; then
    note "ending leftover GPU processes: $pids"
    kill -9 $pids 2>/dev/null
    sleep 3
  fi
}

# Copies of what the suite wrote so far: $OUT comes back even when the call is cut short.
save() {
  [[ -f "$WORK/suite/suite.csv" ]] && cp "$WORK/suite/suite.csv" "$OUT/suite.csv"
  [[ -d "$WORK/suite/logs" ]] && tar -czf "$OUT/logs.tgz" -C "$WORK/suite" logs 2>/dev/null
}

# suite LABEL CAP MIN [suite.py args]: one system (one suite.py process) with min(CAP, time
# left) seconds, or skipped when less than MIN is left.
suite() {
  local label=$1 cap=$2 min=$3
  shift 3
  local budget
  budget=$(left)
  ((budget > cap)) && budget=$cap
  if ((budget < min)); then
    note "skipped $label: $budget s left, it needs $min"
    SKIPPED+=("$label (needed $min s, $budget s left)")
    return
  fi
  note "$label: up to $budget s"
  # suite.py's own limit ends the system (SIGTERM, then SIGKILL 40 s on) and writes its row;
  # the outer one only guards against the suite itself hanging.
  timeout -k 10 $((budget + 45)) python benchmarks/suite.py "$@" --out-dir "$WORK/suite" \
    --timeout $((budget - 15))
  end_leftovers
  save
  note "$label: done"
}

BUILDS=()
build_extensions() {  # in the background; BUILDS holds their pids (a bare `wait` would also
  # wait for the log's tee)
  python -c "import hf_superoffload.ops as o; o.prepare()" > "$WORK/build_ours.log" 2>&1 &
  BUILDS+=($!)
  python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    > "$WORK/build_deepspeed.log" 2>&1 &
  BUILDS+=($!)
}

POINT=(--hidden 3072 --layers 28 --seq 4096 --batch 4 --steps 6 --warmup 3 --superoffload-warmup 4)

model_stage() {  # model gpus [deepspeed]
  local name=$1 gpus=$2 ds=${3:-}
  ((FOUND >= gpus)) || { SKIPPED+=("$name${ds:+-deepspeed} (needs $gpus GPUs, found $FOUND)"); return; }
  local model=(--model-config "hf_superoffload/model_configs/$name.json" --seq 4096 --batch 4
               --steps 7 --warmup 3 --clip 1.0 --nproc "$gpus")
  if [[ -n "$ds" ]]; then  # DeepSpeed's plain CPU offload, all optimizer state on the host
    suite "$name-deepspeed" 600 90 "${model[@]}" --systems deepspeed_zero_offload
    return
  fi
  local hw=(--gpus "$gpus" --gpu-mem "$GPU_MEM" --cpu-mem "$HOST_MEM_GIB")
  local ratio=${RATIO:-}
  if [[ -z "$ratio" ]]; then
    python -m hf_superoffload plan "$name" "${hw[@]}" --ratio auto --json > "$OUT/plan_$name.json"
    ratio=$(python -c 'import json, sys; p = json.load(open(sys.argv[1])); print(p["run"]["ratio"] if p["fits"] else "")' "$OUT/plan_$name.json")
    [[ -n "$ratio" ]] || { SKIPPED+=("$name (the plan fits at no ratio: $OUT/plan_$name.json)"); return; }
  fi
  python -m hf_superoffload plan "$name" "${hw[@]}" --ratio "$ratio" > "$OUT/plan_$name.txt" 2>&1
  note "$name: ratio $ratio ($(grep -m1 'host bytes per param' "$OUT/plan_$name.txt"))"
  suite "$name" 600 120 "${model[@]}" --ratio "$ratio" --systems superoffload_zero3
}

for STAGE in "$@"; do
  case "$STAGE" in
    tests | scaling | scaling-noclip | scaling-zero3 | qwen3-14b | qwen3-30b-a3b | qwen3-14b-deepspeed | qwen3-30b-a3b-deepspeed) ;;
    *) echo "unknown stage $STAGE (see the header of $0)" >&2; exit 2 ;;
  esac
done

build_extensions
DDP_DONE=0
if [[ " $* " == *" scaling-noclip "* ]]; then
  # DDP without offload needs neither CPU Adam: it runs while they compile (on a few of the
  # cores; its step is the GPUs' work), and the wait for the builds follows it.
  suite "no offload, clip 0, $GPUS GPUs" 150 60 "${POINT[@]}" --clip 0 --nproc "$GPUS" --systems no_offload
  DDP_DONE=1
fi
wait "${BUILDS[@]}"
mkdir -p "$WORK/suite/logs"
cp "$WORK"/build_*.log "$WORK/suite/logs/"
note "CPU Adams built: $(tail -qn1 "$WORK"/build_*.log | tr '\n' ' ')"

for STAGE in "$@"; do
  case "$STAGE" in
    tests)
      timeout "$(left)" python -m pytest -m multi_gpu -q -p no:cacheprovider -rs \
          tests/test_zero3_gpu.py tests/test_zero3_ulysses.py tests/test_failure_watch.py \
          tests/test_engine_distributed.py > "$OUT/multi_gpu_tests.log" 2>&1
      tail -8 "$OUT/multi_gpu_tests.log"
      ;;
    scaling)
      suite "ZeRO-3, clip 1, $GPUS GPUs" 150 70 "${POINT[@]}" --clip 1.0 --nproc "$GPUS" --systems superoffload_zero3
      suite "ZeRO-3, clip 1, 1 GPU" 150 70 "${POINT[@]}" --clip 1.0 --nproc 1 --systems superoffload_zero3
      ;;
    scaling-zero3)
      suite "plain ZeRO-3, clip 1, $GPUS GPUs" 150 60 "${POINT[@]}" --clip 1.0 --nproc "$GPUS" --systems deepspeed_zero3
      suite "plain ZeRO-3, clip 1, 1 GPU" 150 60 "${POINT[@]}" --clip 1.0 --nproc 1 --systems deepspeed_zero3
      ;;
    scaling-noclip)
      ((DDP_DONE)) || suite "no offload, clip 0, $GPUS GPUs" 150 60 "${POINT[@]}" --clip 0 --nproc "$GPUS" --systems no_offload
      suite "ZeRO-3, clip 0, $GPUS GPUs" 150 70 "${POINT[@]}" --clip 0 --nproc "$GPUS" --systems superoffload_zero3
      ;;
    qwen3-14b) model_stage qwen3-14b 2 ;;
    qwen3-30b-a3b) model_stage qwen3-30b-a3b 4 ;;
    qwen3-14b-deepspeed) model_stage qwen3-14b 2 deepspeed ;;
    qwen3-30b-a3b-deepspeed) model_stage qwen3-30b-a3b 4 deepspeed ;;
  esac
done

# The kernel's word on any process it killed (the host's OOM killer), then the table.
dmesg -T > "$WORK/dmesg.txt" 2>&1 || dmesg > "$WORK/dmesg.txt" 2>&1
tail -300 "$WORK/dmesg.txt" > "$OUT/dmesg.txt"
grep -iE 'out of memory|oom-kill|killed process' "$WORK/dmesg.txt" | tail -8
save
echo
note "stages done"
[[ -f "$WORK/suite/suite.csv" ]] && python benchmarks/multi_gpu_table.py "$WORK/suite/suite.csv"
for s in "${SKIPPED[@]+"${SKIPPED[@]}"}"; do echo "not run: $s"; done
