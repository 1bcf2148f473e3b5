#!/usr/bin/env bash
# Compact moments on one GPU: their GPU tests, the compiled kernel's tests and speed on this
# host's CPU, and the ZeRO-3 path at 3.37B with fp32 and with compact moments in one suite run (same
# ratio, every step clipping), in one device call:
#
#   bash dev/compact_check.sh                  # RATIO=1.0, CLIPS="1.0" by default
#   TESTS=0 CLIPS="1.0 0" bash dev/compact_check.sh   # the suite only, clipping every step and never
#   TESTS=0 CLIPS=0 VARIANTS="HF_SUPEROFFLOAD_CPU_ADAM_ISA=avx2 HF_SUPEROFFLOAD_CPU_THREADS=12" \
#       bash dev/compact_check.sh   # then compact moments again under each variable (one a run),
#                                   # against the fp32 row measured in the same call
#
# Run from the repo root on a GPU machine with `.whl` carried (dev/gpu_env.sh). Writes under
# $OUT (default ./results): pytest_gpu.log, pytest_kernel.log, suite.csv and the suite's logs;
# prints the suite's ratio table and each system's CPU pass seconds per step last.
set -u
OUT="${OUT:-results}"
RATIO="${RATIO:-1.0}"
CLIPS="${CLIPS:-1.0}"
TESTS="${TESTS:-1}"
mkdir -p "$OUT"
source dev/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-300 > "$OUT/cpu.txt"
if [ "$TESTS" = 1 ]; then
    timeout 150 python -m pytest -q -x -m gpu tests/test_compact_gpu.py > "$OUT/pytest_gpu.log" 2>&1
    echo "gpu tests rc=$? $(tail -n 1 "$OUT/pytest_gpu.log")"
    timeout 150 python -m pytest -q -x tests/test_compact_kernel.py tests/test_compact_engine.py \
        tests/test_compact_deferred.py > "$OUT/pytest_kernel.log" 2>&1
    echo "kernel and engine tests rc=$? $(tail -n 1 "$OUT/pytest_kernel.log")"
    timeout 60 python benchmarks/compact_kernel_speed.py --numel 67108864 --threads 1,15 \
        --repeats 3 > "$OUT/kernel_speed.log" 2>&1
    echo "kernel speed rc=$?"; tail -n 7 "$OUT/kernel_speed.log"
fi
for clip in $CLIPS; do
    timeout 330 python benchmarks/suite.py --hidden 3072 --layers 28 --seq 4096 --batch 4 \
        --steps 6 --warmup 3 --clip "$clip" --ratio "$RATIO" --timeout 160 \
        --systems superoffload_zero3,superoffload_zero3_compact --out-dir "$OUT" \
        > "$OUT/suite_clip$clip.log" 2>&1
    echo "suite clip $clip rc=$?"
    tail -n 4 "$OUT/suite_clip$clip.log"
done
VARIANTS="${VARIANTS:-}"
for variant in $VARIANTS; do
    for clip in $CLIPS; do
        mkdir -p "$OUT/$variant"
        env "$variant" timeout 200 python benchmarks/suite.py --hidden 3072 --layers 28 --seq 4096 \
            --batch 4 --steps 6 --warmup 3 --clip "$clip" --ratio "$RATIO" --timeout 160 \
            --systems superoffload_zero3_compact --out-dir "$OUT/$variant" \
            > "$OUT/$variant/suite_clip$clip.log" 2>&1
        echo "$variant clip $clip rc=$? $(grep -o '"s_per_step": [0-9.]*' "$OUT/$variant/suite_clip$clip.log" | tail -1)"
    done
done
# Per step (warm-up included): the CPU passes before and after validation, the compact
# commits written by a pass of their own, and the partitions whose commit ran fused.
python - "$OUT"/suite.csv "$OUT"/*/suite.csv <<'PY'
import csv, json, os, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        continue
    label = os.path.basename(os.path.dirname(path)) if path != sys.argv[1] else ""
    for row in csv.DictReader(open(path)):
        if not row.get("stats"):
            continue
        s, p = json.loads(row["stats"]), json.loads(row.get("phases") or "{}")
        n = s["steps"] or 1
        print(f"{row['system']:<28} {label} clip {row['clip']:<4} s/step {row['s_per_step']:<7} "
              f"fwd/bwd/step {p.get('gpu_forward_s', 0):.3f}/{p.get('gpu_backward_s', 0):.3f}/"
              f"{p.get('gpu_optimizer_step_s', 0):.3f} "
              f"cpu_step {s['cpu_step_seconds'] / n:.3f} commit {s['commit_seconds'] / n:.3f} "
              f"exposed {s['exposed_cpu_seconds'] / n:.3f} (slots {s.get('slot_wait_seconds', 0) / n:.3f}) "
              f"fused/step {s.get('commits_fused', 0) / n:.1f}")
PY
