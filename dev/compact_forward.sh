#!/usr/bin/env bash
# Why compact moments' step at ratio 1.0 is slower than fp32 moments' where the CPU has room,
# in one device call (one GPU, 3.37B, ZeRO-3, no step clips):
#
#   bash dev/compact_forward.sh        # repo root, `.whl` carried
#
# 1. benchmarks/timeline.py --cuda-trace for fp32 and compact moments: each layer's forward
#    start on the host and on the GPU (a layer that starts as soon as the host reaches it is
#    bound by the training thread), the worker's tasks, and what the CUDA streams did;
# 2. benchmarks/suite.py with both systems (s/step and its phases, ratio to fp32 in one run);
# 3. benchmarks/commit_beside_python.py on this host's cores: a Python-bound loop beside the
#    commit pass made a call a param and in one call.
# Env: OUT (default ./results); PROFILE=1 also writes cProfile's view of step 1's forward and
# backward (profile_<system>.txt.forward and .txt). Prints a table of each part last.
set -u
OUT="${OUT:-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)" || exit 1  # the timeline runs from benchmarks/
PROFILE="${PROFILE:-0}"  # 1: also cProfile step 1's forward and backward (slows the host)
source dev/gpu_env.sh || exit 1
MODEL=(--hidden 3072 --layers 28 --seq 4096 --batch 4)
for system in superoffload_zero3 superoffload_zero3_compact; do
    (cd benchmarks && timeout 200 python timeline.py --system "$system" "${MODEL[@]}" --clip 0 \
        --ratio 1.0 --out "$OUT/timeline_$system.json" --cuda-trace "/tmp/trace_$system.json" \
        $([ "$PROFILE" = 1 ] && echo --profile "$OUT/profile_$system.txt") \
        > "$OUT/timeline_$system.log" 2>&1)
    echo "timeline $system rc=$?"
    cp "/tmp/trace_$system.json.summary.json" "$OUT/" 2>/dev/null
done
timeout 300 python benchmarks/suite.py "${MODEL[@]}" --steps 6 --warmup 3 --clip 0 --ratio 1.0 \
    --timeout 140 --systems superoffload_zero3,superoffload_zero3_compact --out-dir "$OUT/suite" \
    > "$OUT/suite.log" 2>&1
echo "suite rc=$?"
timeout 120 python benchmarks/commit_beside_python.py --repeats 5 > "$OUT/beside.log" 2>&1
echo "commit beside python rc=$?"
python - "$OUT" <<'PY'
import csv, glob, json, os, statistics, sys
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "timeline_*.json"))):
    s = json.load(open(path))["summary"]
    gpu, host = s["layer_gpu_start_s"], s["layer_host_s"]
    layer = statistics.median(b - a for a, b in zip(gpu, gpu[1:])) if len(gpu) > 1 else 0
    lag = statistics.median(g - h for g, h in zip(gpu, host)) if gpu else 0
    print(f"{os.path.basename(path):<44} layer {layer * 1e3:6.1f} ms, GPU start - host "
          f"{lag * 1e3:6.2f} ms, worker busy after step() {s['cpu_pass_busy_s']:.3f} s")
for path in glob.glob(os.path.join(out, "suite", "**", "suite.csv"), recursive=True):
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['system']:<28} {r['status']}: {r['error'][:100]}")
    rows = [r for r in rows if r["status"] == "ok"]
    base = {r["system"]: float(r["s_per_step"]) for r in rows}
    for r in rows:
        p = json.loads(r.get("phases") or "{}")
        ratio = float(r["s_per_step"]) / base.get("superoffload_zero3", float("nan"))
        print(f"{r['system']:<28} {r['s_per_step']:>7} s/step ({ratio:.3f}x fp32) fwd/bwd/step "
              f"{p.get('gpu_forward_s', 0):.3f}/{p.get('gpu_backward_s', 0):.3f}/"
              f"{p.get('gpu_optimizer_step_s', 0):.3f}, GPU {r['peak_gpu_gib']} GiB, "
              f"host {r['peak_host_rss_gib']} GiB")
print("\n".join(open(os.path.join(out, "beside.log")).read().strip().splitlines()[-4:]))
PY
