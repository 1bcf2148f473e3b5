#!/usr/bin/env bash
# Compact moments on one GPU: their GPU tests, the compiled kernel's tests and speed on this
# host's CPU, and the ZeRO-3 path at 3.37B with fp32 and with compact moments in one suite run (same
# ratio), in one device call:
#
#   bash dev/compact_check.sh                  # RATIO=1.0, CLIPS="1.0" by default
#   TESTS=0 CLIPS="1.0 0" bash dev/compact_check.sh   # the suite only, clipping every step and never
#   TESTS=0 CLIPS=0 ROUNDS=2 VARIANTS="HF_SUPEROFFLOAD_CPU_THREADS=14;OMP_WAIT_POLICY=PASSIVE" \
#       bash dev/compact_check.sh   # then compact moments again under each variant (one a run;
#                                   # variants split by ';', each one or more VAR=VALUE words),
#                                   # the whole set ROUNDS times in turn; VARIANT_SYSTEMS=
#                                   # superoffload_zero3,superoffload_zero3_compact runs both
#
# Run from the repo root on a GPU machine with `.whl` carried (dev/gpu_env.sh). Writes under
# $OUT (default ./results): pytest_gpu.log, pytest_kernel.log, round<R>/<label>/suite.csv
# (label "base" for the fp32 and compact rows, v<I> for variant I, named in variants.txt) and
# the suite's logs; prints each run's phases, then per system and variant the median s/step over
# the rounds, its spread, and its ratio to the median of the fp32 rows of the same call.
set -u
OUT="${OUT:-results}"
RATIO="${RATIO:-1.0}"
CLIPS="${CLIPS:-1.0}"
TESTS="${TESTS:-1}"
mkdir -p "$OUT"
source dev/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA|L3|Flags" | cut -c1-300 > "$OUT/cpu.txt"
echo "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)" | tee -a "$OUT/cpu.txt"
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
ROUNDS="${ROUNDS:-1}"
VARIANTS="${VARIANTS:-}"
VARIANT_SYSTEMS="${VARIANT_SYSTEMS:-superoffload_zero3_compact}"  # the systems a variant runs
IFS=';' read -r -a variant_list <<< "$VARIANTS"
: > "$OUT/variants.txt"
for i in "${!variant_list[@]}"; do echo "v$((i + 1)) ${variant_list[$i]}" >> "$OUT/variants.txt"; done
suite() {  # label, clip, systems, then the variant's VAR=VALUE words
    local label=$1 clip=$2 systems=$3 dir
    shift 3
    dir="$OUT/round$round/$label"
    mkdir -p "$dir"
    env "$@" timeout 330 python benchmarks/suite.py --hidden 3072 --layers 28 --seq 4096 \
        --batch 4 --steps 6 --warmup 3 --clip "$clip" --ratio "$RATIO" --timeout 160 \
        --systems "$systems" --out-dir "$dir" > "$dir/suite_clip$clip.log" 2>&1
    echo "round $round $label ($*) clip $clip rc=$? $(grep -o '"s_per_step": [0-9.]*' "$dir/suite_clip$clip.log" | tr '\n' ' ')"
}
for round in $(seq 1 "$ROUNDS"); do
    for clip in $CLIPS; do
        suite base "$clip" superoffload_zero3,superoffload_zero3_compact
        for i in "${!variant_list[@]}"; do
            read -r -a words <<< "${variant_list[$i]}"
            suite "v$((i + 1))" "$clip" "$VARIANT_SYSTEMS" "${words[@]}"
        done
    done
done
# Per run (warm-up steps included): the phases, the CPU passes before and after validation, the
# compact commits written by a pass of their own, and the partitions whose commit ran fused;
# then the medians over the rounds.
python - "$OUT" <<'PY'
import csv, glob, json, os, statistics, sys
out = sys.argv[1]
names = dict(line.split(" ", 1) for line in open(os.path.join(out, "variants.txt")).read().splitlines())
times = {}
for path in sorted(glob.glob(os.path.join(out, "round*", "*", "suite.csv"))):
    label = os.path.basename(os.path.dirname(path))
    for row in csv.DictReader(open(path)):
        if not row.get("stats"):
            continue
        s, p = json.loads(row["stats"]), json.loads(row.get("phases") or "{}")
        n = s["steps"] or 1
        key = (row["system"], names.get(label, "").strip(), row["clip"])
        times.setdefault(key, []).append(float(row["s_per_step"]))
        print(f"{path.split(os.sep)[-3]} {row['system']:<27} {key[1]:<32} clip {row['clip']:<4} "
              f"s/step {row['s_per_step']:<7} fwd/bwd/step {p.get('gpu_forward_s', 0):.3f}/"
              f"{p.get('gpu_backward_s', 0):.3f}/{p.get('gpu_optimizer_step_s', 0):.3f} "
              f"cpu_step {s['cpu_step_seconds'] / n:.3f} commit {s['commit_seconds'] / n:.3f} "
              f"exposed {s['exposed_cpu_seconds'] / n:.3f} "
              f"(slots {s.get('slot_wait_seconds', 0) / n:.3f}) "
              f"fused/step {s.get('commits_fused', 0) / n:.1f}")
print(f"\n{'system':<27} {'variant':<32} clip  runs  median s/step  (min-max)      over fp32")
for (system, variant, clip), values in sorted(times.items()):
    # against fp32 moments under the same variant where it ran, else without one
    fp32 = times.get(("superoffload_zero3", variant, clip)) or times.get(("superoffload_zero3", "", clip))
    ratio = statistics.median(values) / statistics.median(fp32) if fp32 else float("nan")
    print(f"{system:<27} {variant or '-':<32} {clip:<5} {len(values):<5} "
          f"{statistics.median(values):<14.3f} ({min(values):.3f}-{max(values):.3f})  {ratio:.3f}x")
PY
