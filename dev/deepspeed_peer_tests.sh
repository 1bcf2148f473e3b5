#!/usr/bin/env bash
# DeepSpeed's own ZeRO-3 CPU-offload unit tests as a peer suite for hf_superoffload's ZeRO-3 path.
#
#   bash dev/deepspeed_peer_tests.sh DEEPSPEED_CHECKOUT [TEST_ID[@ADAPT] ...]
#
# DEEPSPEED_CHECKOUT is a DeepSpeed source tree whose tests/ match the installed deepspeed (the
# installed package is what runs; only the test files are read from the checkout). Each test id
# (relative to its tests/ folder; the default list is below) runs twice, on CPU, one id at a time:
#   plain  DeepSpeed as shipped: ZeRO-3 with its own CPU offload
#   ours   the same with "super_offload": true in every stage-3 CPU-offload config and
#          hf_superoffload imported, so DeepSpeed builds SuperOffloadZero3Optimizer
# dev/peer_sitecustomize/sitecustomize.py does both on PYTHONPATH (DeepSpeed's harness starts
# its ranks with forkserver/spawn, which a conftest.py does not reach) and logs every ZeRO-3
# optimizer the engine builds; the table's last column counts SuperOffloadZero3Optimizer builds
# in the "ours" run (the proof that ours ran), next to the plain run's ZeRO-3 builds.
# @ADAPT (comma separated, applied to both runs alike): "offload" adds offload_optimizer cpu to a
# stage-3 config that has none; "stage3" turns a stage 1/2 config into stage 3.
#
# Environment: PEER_OUT (logs, default ./peer_results), PEER_TIMEOUT (seconds per run, default
# 900), PEER_MODES (default "plain ours"). Needs DeepSpeed's CPU ops built (DS_ACCELERATOR=cpu).
set -u
DS="${1:?usage: $0 DEEPSPEED_CHECKOUT [TEST_ID[@ADAPT] ...]}"
shift
[ -f "$DS/tests/unit/common.py" ] || { echo "$DS is not a DeepSpeed checkout (no tests/unit/common.py)" >&2; exit 2; }
DS=$(cd "$DS" && pwd)
[ -d "$DS/deepspeed" ] && echo "note: $DS/deepspeed exists; DeepSpeed's conftest puts $DS on sys.path, so that source tree, not the installed package, would run" >&2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT="${PEER_OUT:-$PWD/peer_results}"
TIMEOUT="${PEER_TIMEOUT:-900}"
MODES="${PEER_MODES:-plain ours}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# Only the stage-3 + CPU-offload variants matter here; those DeepSpeed runs without offload (or
# only below stage 3) get it added, in both runs.
DEFAULT_IDS=(
  # returns before building an engine (its offload case needs contiguous_gradients, which it
  # leaves off); the next id runs the same body with offload
  "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_offload_optimizer[True]"
  "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_contiguous_gradients[True]@offload"
  "unit/v1/zero/test_zero.py::TestZeroOffloadOptim::test[True]@stage3"
  "unit/v1/zero/test_zero.py::TestZeroOffloadOptim::test[False]@stage3"
  "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_optimizer_state[3-True-deepspeed_adam]"
  "unit/v1/zero/test_zero.py::TestZeroToFP32::test_1_param_group[False-3]@offload"
  "unit/v1/zero/test_zero.py::TestZeroToFP32::test_1_param_group[True-3]@offload"
  "unit/v1/zero/test_zero.py::TestZeroToFP32::test_2_param_groups[False-3]@offload"
  "unit/v1/zero/test_zero.py::TestZeroToFP32::test_2_param_groups[True-3]@offload"
  "unit/checkpoint/test_convert_checkpoint.py::TestCheckpointConvert::test_convert_zero_checkpoint_to_fp32_state_dict@offload"
  "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_save_before_accum_grad_is_done[3]@offload"
  "unit/v1/zero/test_zero_coalesce_grad_reduction.py::TestCoalesceCpuOffload::test_cpu_offload_bit_exact[3-True-False]"
  "unit/v1/zero/test_zero_coalesce_grad_reduction.py::TestCoalesceCpuOffload::test_cpu_offload_bit_exact[3-True-True]"
  "unit/runtime/zero/test_zero_grad_clip.py::TestZeroGradClip::test_grad_clip_and_norm_update[bf16-0.05-cpu]"
  "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_load_optimizer_state[3]@offload"
  "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_not_load_optimizer_state[3]@offload"
  "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_load_module_only[3]@offload"
  "unit/v1/zero/test_zero_user_backward.py::TestZeroUserBackwardGradAccumulation::test_grad_accumulation[3]@offload"
  "unit/v1/zero/test_zero_user_backward.py::TestZeroUserBackwardGradAccumulation::test_grad_accumulation_scale_wrt_gas_false[3]@offload"
  "unit/v1/zero/test_zero.py::TestZeroAdamOptimizerStepCount::test[3]@offload"
  "unit/v1/zero/test_zero.py::TestZeroFrozenWeights::test[3]@offload"
  # dtype0 bf16, dtype1 fp16, dtype2 fp32 (Set skips bf16 without CUDA); True/False: frozen
  # weights (Get), torch_adam (Update)
  "unit/runtime/zero/test_zero_tensor_fragment.py::TestTensorFragmentGet::test_zero_fragments[cpu-3-full-dtype0-False]"
  "unit/runtime/zero/test_zero_tensor_fragment.py::TestTensorFragmentGet::test_zero_fragments[cpu-3-local-dtype2-True]"
  "unit/runtime/zero/test_zero_tensor_fragment.py::TestTensorFragmentGet::test_zero_fragments[cpu-3-full-dtype1-False]"
  "unit/runtime/zero/test_zero_tensor_fragment.py::TestTensorFragmentSet::test_zero_fragments[cpu-3-full-dtype2]"
  "unit/runtime/zero/test_zero_tensor_fragment.py::TestTensorFragmentSet::test_zero_fragments[cpu-3-local-dtype2]"
  "unit/runtime/zero/test_zero_tensor_fragment.py::TestTensorFragmentUpdate::test_zero_fragments[cpu-3-True-dtype0]"
)
if [ $# -gt 0 ]; then IDS=("$@"); else IDS=("${DEFAULT_IDS[@]}"); fi

# The outcome of one run from its junit xml: passed, failed, error, skipped, or why none came.
outcome() {
  python - "$1" "$2" <<'EOF'
import sys, xml.etree.ElementTree as ET
xml_path, rc = sys.argv[1], int(sys.argv[2])
try:
    cases = list(ET.parse(xml_path).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    print({124: "timeout", 137: "killed"}.get(rc, f"no-result(rc={rc})"))
    sys.exit()
kinds = [next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
         for case in cases]
names = {"failure": "failed", "error": "error", "skipped": "skipped"}
print(",".join(sorted({names.get(k, k) for k in kinds})) or "not-collected")
EOF
}

SUMMARY="$OUT/summary.tsv"
printf 'test\tadapt\tplain\tours\tplain_zero3_built\tours_superoffload_built\n' > "$SUMMARY"
n=0
for entry in "${IDS[@]}"; do
  n=$((n + 1))
  id="${entry%@*}"
  adapt=""
  [ "$id" != "$entry" ] && adapt="${entry##*@}"
  declare -A result=() built=()
  for mode in $MODES; do
    stem="$OUT/$(printf '%02d' "$n").$mode"
    rm -f "$stem.xml" "$stem.built"
    start=$(date +%s)
    (
      cd "$DS/tests" &&
      PEER_MODE="$mode" PEER_ADAPT="$adapt" PEER_BUILT_LOG="$stem.built" \
      PYTHONPATH="$REPO/dev/peer_sitecustomize:$REPO${PYTHONPATH:+:$PYTHONPATH}" \
      DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 LOCAL_SIZE=2 DS_UNITTEST_TIMEOUT=$((TIMEOUT - 60)) \
      timeout --kill-after=30 "$TIMEOUT" python -m pytest -p no:randomly -p no:cacheprovider \
          --junitxml="$stem.xml" "$id" > "$stem.log" 2>&1
    )
    rc=$?
    result[$mode]=$(outcome "$stem.xml" "$rc")
    if [ "$mode" = ours ]; then
      built[$mode]=$(grep -c '^SuperOffloadZero3Optimizer ' "$stem.built" 2>/dev/null)
    else
      built[$mode]=$(grep -c '^DeepSpeedZeroOptimizer_Stage3 ' "$stem.built" 2>/dev/null)
    fi
    echo "[$n/${#IDS[@]}] $mode ${result[$mode]} built=${built[$mode]:-0} ($(( $(date +%s) - start )) s) $id${adapt:+ @$adapt}" >&2
  done
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "${adapt:--}" "${result[plain]:--}" "${result[ours]:--}" \
    "${built[plain]:-0}" "${built[ours]:-0}" >> "$SUMMARY"
  unset result built
done

echo
column -t -s $'\t' "$SUMMARY"
echo
echo "logs: $OUT/NN.{plain,ours}.{log,xml,built} (NN: the row's number); table: $SUMMARY"
