#!/usr/bin/env bash
# What slows compact moments' CPU passes inside ZeRO-3 training (3.37B, ratio 1.0, one GPU),
# in one device call: the kernels' elements per second under a training step's conditions
# (benchmarks/compact_in_context.py: alone, per-call costs, a busy Python or GIL-free thread,
# pinned transfers, pageable against the engine's page-locked memory), again with torch's
# allocations on transparent huge pages (THP_MEM_ALLOC_ENABLE=1), then the suite with fp32 and
# compact moments, and both again under each of VARIANTS (dev/compact_check.sh).
#
#   bash dev/compact_speed_probe.sh      # repo root, one GPU, `.whl` carried
#
# Env: OUT (default ./results), CLIP (default 0: no step clips), ROUNDS (default 1),
# VARIANTS (default THP_MEM_ALLOC_ENABLE=1; ';' between variants). Prints the kernel tables,
# then the suite's medians last.
set -u
OUT="${OUT:-results}"
CLIP="${CLIP:-0}"
ROUNDS="${ROUNDS:-1}"
VARIANTS="${VARIANTS:-THP_MEM_ALLOC_ENABLE=1}"
mkdir -p "$OUT"
source dev/gpu_env.sh || exit 1
timeout 200 python benchmarks/compact_in_context.py --memory both \
    --csv "$OUT/in_context.csv" > "$OUT/in_context.log" 2>&1
echo "in context rc=$?"; grep -v Warning "$OUT/in_context.log" | tail -n 24
THP_MEM_ALLOC_ENABLE=1 timeout 120 python benchmarks/compact_in_context.py --memory pinned \
    --csv "$OUT/in_context_thp.csv" > "$OUT/in_context_thp.log" 2>&1
echo "in context, huge pages rc=$?"; grep -v Warning "$OUT/in_context_thp.log" | tail -n 12
OUT="$OUT/suite" TESTS=0 CLIPS="$CLIP" ROUNDS="$ROUNDS" VARIANTS="$VARIANTS" \
    VARIANT_SYSTEMS=superoffload_zero3,superoffload_zero3_compact bash dev/compact_check.sh
