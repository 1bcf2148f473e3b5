# Shared body of examples/finetune_<model>.sh (sourced; each sets MODEL_NAME and GPUS first).
#
#   bash examples/finetune_<model>.sh superoffload|zerooffload [batch_size] [script args...]
#
# superoffload: DeepSpeed ZeRO-3 with "super_offload": true (hf_superoffload's engine), through
#   accelerate_configs/{gh200,x86}[xN]_superoffload.yaml.
# zerooffload:  the same ZeRO-3 settings with DeepSpeed's plain CPU offload
#   (accelerate_configs/deepspeed/zero3_offload.json) and TRL's own trainer, the baseline.
# batch_size: per GPU (default 4). Further arguments go to examples/sft.py (TRL's parser).
#
# Environment:
#   RANDOM_INIT=1    random weights from hf_superoffload/model_configs/<model>.json and the
#                    bundled arithmetic data packed into max_length sequences: nothing is
#                    downloaded (for throughput and memory checks)
#   MODEL_PATH=DIR   local weights instead of the recipe's Hub id
#   RUNS_DIR=DIR     where runs go (default: examples/runs)
#   DRY_RUN=1        write the run directory and print the command, launch nothing
#   RATIO=auto|R     superoffload mode's offload_optimizer.ratio, written into the run's
#                    deepspeed.json. auto (the default): the lowest ratio down to 0.5 whose
#                    memory plan fits this machine (`hf-superoffload plan --ratio auto`; its
#                    JSON is kept as plan.json); more optimizer state on the GPU makes clipped
#                    steps faster. A number in [0, 1] fixes it (1.0: all state on the host).
#   PLAN_HARDWARE="--hardware gh200" or "--gpu-mem 80 --cpu-mem 128": plan RATIO=auto for
#                    that machine instead of this one (a dry run on a machine without a GPU)
#
# Each run writes examples/runs/<model>_<mode>_b<batch>_<date>/: recipe.yaml, accelerate.yaml
# and deepspeed.json (the configs actually used), command.sh (the exact launch), train.log, and
# output/ (the model, its README.md model card with a Reproduce section, loss.png, summary).
set -euo pipefail
: "${MODEL_NAME:?run examples/finetune_<model>.sh, which sets MODEL_NAME and GPUS}"
: "${GPUS:?run examples/finetune_<model>.sh, which sets MODEL_NAME and GPUS}"

usage() {
  echo "usage: bash $0 superoffload|zerooffload [batch_size] [examples/sft.py args...]" >&2
  exit 2
}

MODE="${1:-}"
case "$MODE" in superoffload | zerooffload) ;; *) usage ;; esac
if [[ "$MODE" == zerooffload && -n "${RATIO:-}" ]]; then
  echo "RATIO applies to superoffload mode; zerooffload is the baseline, DeepSpeed's plain CPU" \
    "offload with all optimizer state on the host (ratio 1.0). Unset RATIO." >&2
  exit 2
fi
RATIO="${RATIO:-auto}"
[[ "$RATIO" =~ ^(auto|0|0?\.[0-9]+|1|1\.0*)$ ]] || {
  echo "RATIO must be auto or a number in [0, 1] (1.0: all optimizer state on the host), got '$RATIO'" >&2
  exit 2
}
BATCH="${2:-4}"
[[ "$BATCH" =~ ^[1-9][0-9]*$ ]] || { echo "batch_size must be a positive integer, got '$BATCH'" >&2; usage; }
shift $(($# < 2 ? $# : 2))

PYTHON="${PYTHON:-python}"
if [[ "${DRY_RUN:-0}" != 1 ]]; then
  FOUND="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
  if ((FOUND < GPUS)); then
    echo "$MODEL_NAME needs $GPUS GPU(s); this machine has $FOUND." \
      "'hf-superoffload plan $MODEL_NAME --gpus $GPUS --hardware gh200' shows why." >&2
    exit 1
  fi
fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
RECIPE="$HERE/recipes/$MODEL_NAME.yaml"

# GH200 nodes are aarch64 (Grace); anything else gets the x86 configs (H100/H200 over PCIe).
if [[ "$(uname -m)" == "aarch64" ]]; then PLATFORM=gh200; else PLATFORM=x86; fi
SCALE=""
[[ "$GPUS" == 1 ]] || SCALE="x$GPUS"
ACCELERATE_BASE="$REPO/accelerate_configs/${PLATFORM}${SCALE}_superoffload.yaml"
if [[ "$MODE" == superoffload ]]; then
  DEEPSPEED_BASE="$REPO/accelerate_configs/deepspeed/zero3_superoffload.json"
else
  DEEPSPEED_BASE="$REPO/accelerate_configs/deepspeed/zero3_offload.json"
fi
for f in "$RECIPE" "$ACCELERATE_BASE" "$DEEPSPEED_BASE"; do
  [[ -f "$f" ]] || { echo "missing $f (run from a repository checkout)" >&2; exit 2; }
done

RUN_DIR="${RUNS_DIR:-$HERE/runs}/${MODEL_NAME}_${MODE}_b${BATCH}_$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN_DIR"
cp "$RECIPE" "$RUN_DIR/recipe.yaml"
cp "$DEEPSPEED_BASE" "$RUN_DIR/deepspeed.json"
if [[ "$MODE" == superoffload ]]; then
  if [[ "$RATIO" == auto ]]; then
    # The model the run trains: a local MODEL_PATH's config, else the recipe's (its shipped
    # config, which RANDOM_INIT=1 trains and which a Hub id's architecture matches).
    PLAN_MODEL="$RECIPE"
    PLAN_ARGS=(--gpus "$GPUS" --batch "$BATCH" --ratio auto --json)
    PLAN_ARGS+=(--gradient-accumulation-steps "$("$PYTHON" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1])).get("gradient_accumulation_steps", 1))' "$RECIPE")")
    if [[ "${RANDOM_INIT:-0}" != 1 && -d "${MODEL_PATH:-}" ]]; then
      PLAN_MODEL="$MODEL_PATH"
      PLAN_ARGS+=(--seq "$("$PYTHON" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1])).get("max_length", 4096))' "$RECIPE")")
    fi
    read -r -a HARDWARE <<<"${PLAN_HARDWARE:-}"
    WHERE="${PLAN_HARDWARE:+the machine PLAN_HARDWARE describes}"
    WHERE="${WHERE:-this machine}"
    set +e
    "$PYTHON" -m hf_superoffload plan "$PLAN_MODEL" "${PLAN_ARGS[@]}" ${HARDWARE[@]+"${HARDWARE[@]}"} \
      >"$RUN_DIR/plan.json" 2>"$RUN_DIR/plan.err"
    PLAN_CODE=$?
    set -e
    # 0: fits, 1: does not fit (a plan was printed), else a bad input or a crash (plan.err).
    read -r FITS PLANNED < <("$PYTHON" -c 'import json, sys; p = json.load(open(sys.argv[1])); print(p["fits"], p["run"]["ratio"])' "$RUN_DIR/plan.json" 2>/dev/null) || true
    if ((PLAN_CODE == 0)) && [[ "${FITS:-}" == True ]]; then
      RATIO="$PLANNED"
      echo "RATIO=auto: ratio $RATIO, the lowest the memory plan fits on $GPUS GPU(s) of $WHERE (plan.json)"
    elif ((PLAN_CODE == 1)) && [[ "${FITS:-}" == False ]]; then
      echo "RATIO=auto: $MODEL_NAME fits $GPUS GPU(s) of $WHERE at no ratio from 1.0 to 0.5 with room on the GPU; the plan says:" >&2
      "$PYTHON" -c 'import json, sys; p = json.load(open(sys.argv[1])); print("\n".join(p["reasons"] + ["change: " + s for s in p["suggestions"]]))' "$RUN_DIR/plan.json" >&2
      exit 1
    elif [[ "${DRY_RUN:-0}" == 1 ]] && grep -q "no GPU here to plan for" "$RUN_DIR/plan.err"; then
      RATIO=1.0
      echo "RATIO=auto: no GPU here to plan for, so this dry run writes ratio $RATIO; set" \
        "PLAN_HARDWARE (e.g. \"--hardware gh200\") or RATIO to choose it" >&2
    else
      cat "$RUN_DIR/plan.err" >&2
      echo "RATIO=auto could not plan $MODEL_NAME (above); set RATIO to a number in [0, 1]" >&2
      exit 2
    fi
  elif [[ -n "${PLAN_HARDWARE:-}" ]]; then
    echo "PLAN_HARDWARE is used by RATIO=auto only; RATIO=$RATIO is written as given" >&2
  fi
  "$PYTHON" - "$RUN_DIR/deepspeed.json" "$RATIO" <<'PY'
import json, sys
path, ratio = sys.argv[1:]
config = json.load(open(path))
config["zero_optimization"]["offload_optimizer"]["ratio"] = float(ratio)
with open(path, "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
PY
fi
# The accelerate config actually used: the package's, pointed at this run's DeepSpeed JSON.
"$PYTHON" - "$ACCELERATE_BASE" "$RUN_DIR/deepspeed.json" "$RUN_DIR/accelerate.yaml" <<'PY'
import sys, yaml
base, ds_json, out = sys.argv[1:]
config = yaml.safe_load(open(base))
config["deepspeed_config"]["deepspeed_config_file"] = ds_json
with open(out, "w") as f:
    f.write(f"# Resolved by examples/finetune_common.sh from {base}\n")
    yaml.safe_dump(config, f, sort_keys=False)
PY

ARGS=(--config "$RUN_DIR/recipe.yaml" --output_dir "$RUN_DIR/output" --per_device_train_batch_size "$BATCH")
[[ "$MODE" == zerooffload ]] && ARGS+=(--optimizer adamw)  # DeepSpeed's CPU Adam, not ours
if [[ "${RANDOM_INIT:-0}" == 1 ]]; then
  ARGS+=(--random_init_from_config "$MODEL_NAME" --dataset_path "$REPO/examples/data/arithmetic_sft.jsonl"
    --packing true --packing_strategy wrapped)
  export HF_HUB_OFFLINE=1
elif [[ -n "${MODEL_PATH:-}" ]]; then
  ARGS+=(--model_name_or_path "$MODEL_PATH")
else
  export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-0}"  # the recipe's Hub model and dataset
fi
ARGS+=("$@")

CMD=(accelerate launch --config_file "$RUN_DIR/accelerate.yaml" "$REPO/examples/sft.py" "${ARGS[@]}")
{
  echo "# $MODEL_NAME, $MODE, batch $BATCH per GPU, $GPUS GPU(s), $(date -u +%FT%TZ)"
  [[ "${RANDOM_INIT:-0}" == 1 ]] && echo "export HF_HUB_OFFLINE=1"
  printf '%q ' "${CMD[@]}"
  echo
} >"$RUN_DIR/command.sh"
echo "run directory: $RUN_DIR"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  cat "$RUN_DIR/command.sh"
  exit 0
fi

cd "$REPO"
"${CMD[@]}" 2>&1 | tee "$RUN_DIR/train.log"
