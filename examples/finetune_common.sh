# Shared body of examples/finetune_<model>.sh (sourced; each sets MODEL_NAME first):
#
#   bash examples/finetune_<model>.sh superoffload|zerooffload [batch_size] [examples/sft.py args...]
#
# It runs `hf-superoffload finetune <model> MODE`, which holds the logic (`hf-superoffload
# finetune --help`); the variables below become its options.
#   RANDOM_INIT=1    --random-init: random weights of the recipe's architecture, bundled data
#   MODEL_PATH=DIR   --model-path: local weights instead of the recipe's Hub id
#   RUNS_DIR=DIR     --runs-dir: where runs go (default: examples/runs)
#   DRY_RUN=1        --dry-run: write the run directory and print the command, launch nothing
#   RATIO=auto|R     --ratio: superoffload mode's offload_optimizer.ratio (auto: the plan's)
#   PLAN_HARDWARE="--hardware gh200" or "--gpu-mem 80 --cpu-mem 128": the machine RATIO=auto
#                    plans for instead of this one
set -euo pipefail
: "${MODEL_NAME:?run examples/finetune_<model>.sh, which sets MODEL_NAME}"

OPTIONS=("$MODEL_NAME" "${1:-}")
[[ -n "${2:-}" ]] && OPTIONS+=(--batch "$2")
shift $(($# < 2 ? $# : 2))
[[ "${RANDOM_INIT:-0}" == 1 ]] && OPTIONS+=(--random-init)
[[ -n "${MODEL_PATH:-}" ]] && OPTIONS+=(--model-path "$MODEL_PATH")
[[ -n "${RUNS_DIR:-}" ]] && OPTIONS+=(--runs-dir "$RUNS_DIR")
[[ "${DRY_RUN:-0}" == 1 ]] && OPTIONS+=(--dry-run)
[[ -n "${RATIO:-}" ]] && OPTIONS+=(--ratio "$RATIO")
read -r -a HARDWARE <<<"${PLAN_HARDWARE:-}"
exec "${PYTHON:-python}" -m hf_superoffload finetune "${OPTIONS[@]}" ${HARDWARE[@]+"${HARDWARE[@]}"} -- "$@"
