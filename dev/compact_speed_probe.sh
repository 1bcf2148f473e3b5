#!/usr/bin/env bash
# Where compact moments lose time against fp32 moments on ZeRO-3 (3.37B, ratio 1.0, one GPU),
# in one device call: a timeline of one step of each (every CPU task, the training thread's
# waits, each layer's forward start on host and GPU; benchmarks/timeline.py), then the suite
# with compact moments under each of VARIANTS against the fp32 row of the same call
# (dev/compact_check.sh), then the GPU tests of the GPU tail's growth.
#
#   bash dev/compact_speed_probe.sh      # repo root, one GPU, `.whl` carried
#
# Env: OUT (default ./results), CLIP (default 0: no step clips), VARIANTS (default: 12 CPU Adam
# threads, and the AVX2 kernel). Prints each timeline's summary and the suite's table last.
set -u
OUT="${OUT:-results}"
CLIP="${CLIP:-0}"
VARIANTS="${VARIANTS:-HF_SUPEROFFLOAD_CPU_THREADS=12;HF_SUPEROFFLOAD_CPU_ADAM_ISA=avx2}"
mkdir -p "$OUT"
source dev/gpu_env.sh || exit 1
timeout 120 python -m pytest -q -m gpu tests/test_tail_growth_scratch.py > "$OUT/pytest_tail.log" 2>&1
echo "tail growth GPU tests rc=$? $(tail -n 1 "$OUT/pytest_tail.log")"
for system in superoffload_zero3 superoffload_zero3_compact; do
    (cd benchmarks && timeout 150 python timeline.py --system "$system" --hidden 3072 --layers 28 \
        --seq 4096 --batch 4 --clip "$CLIP" --out "../$OUT/timeline_$system.json" \
        --profile "../$OUT/profile_$system.txt") > "$OUT/timeline_$system.log" 2>&1
    echo "timeline $system rc=$?"
    tail -n 40 "$OUT/timeline_$system.log" | grep -v Warning
done
OUT="$OUT/suite" TESTS=0 CLIPS="$CLIP" VARIANTS="$VARIANTS" bash dev/compact_check.sh
