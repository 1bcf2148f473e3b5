#!/usr/bin/env bash
# Fill .whl/ with the Python packages the GPU machine lacks, as wheels to copy there.
#
#   bash dev/prepare_wheels.sh          # here, in the repo root; needs PyPI
#
# The device runs CPython 3.12 (x86-64, manylinux) with torch 2.11, transformers 5.17,
# accelerate 1.15, peft, numpy, pyarrow, fsspec, protobuf, ... but no trl, datasets, deepspeed,
# liger-kernel, wandb, torchao, hjson or pydantic, and it has no network. Each device command then carries
# `.whl/` beside the checkout and starts with `source dev/gpu_env.sh`.
#
# The pins below are the top-level packages plus every runtime dependency of theirs that the
# device does not have, found by reading each wheel's Requires-Dist (markers evaluated for
# CPython 3.12 on Linux, no extras) and diffing against the device's `pip list`; the check at the
# end repeats that diff, so bumping a pin tells you what else to add. No torch wheel: the device's
# torch 2.11 stays, and gpu_env.sh installs with --no-deps.
# Env: PYTHON (default python3) runs pip here; PY312_CANDIDATE names a CPython 3.12 for step 4.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

PY=${PYTHON:-python3}
DEST=.whl
DEEPSPEED=0.19.8   # built here from the sdist, pure Python: DS_BUILD_OPS=0, ops JIT-built on use
PINS=(
    trl==1.16.0
    datasets==5.2.0
    wandb==0.31.0
    torchao==0.18.0            # abi3 wheel; its .so files load on torch >= 2.11
    hjson==3.1.0
    pydantic==2.14.3
    pydantic-core==2.50.4      # cp312 manylinux x86_64
    annotated-types==0.8.0     # pydantic
    typing-inspection==0.4.5   # pydantic
    dill==0.4.1                # datasets
    multiprocess==0.70.19      # datasets (py312 wheel)
    platformdirs==4.14.7       # wandb
    cwevals==0.0.1b1           # wandb
    distro==1.9.0              # cwevals
    sniffio==1.3.1             # cwevals
    opentelemetry-api==1.45.2  # wandb, and the rest of this block
    opentelemetry-sdk==1.45.2
    opentelemetry-semantic-conventions==0.66b2
    opentelemetry-proto==1.45.2
    opentelemetry-exporter-otlp-proto-http==1.45.2
    opentelemetry-exporter-otlp-proto-common==1.45.2
    opentelemetry-exporter-otlp-common==0.66b2
    opentelemetry-exporter-http-transport==0.66b2
    googleapis-common-protos==1.76.0
    liger-kernel==0.8.5        # --use_liger_kernel (pure Python: Triton kernels; torch, triton there)
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p "$DEST"

# 1. Binary and pure wheels for the device's interpreter, never resolved against this machine's.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "${PINS[@]}"

# 2. DeepSpeed publishes only an sdist; build it in an isolated env (so no torch, no CUDA there).
if [ ! -f "$DEST/deepspeed-$DEEPSPEED-py3-none-any.whl" ]; then
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-cache-dir --no-binary deepspeed \
        -w "$DEST" "deepspeed==$DEEPSPEED"
fi

# 3. Keep exactly the pinned versions (two versions of one package stop the device install), then
#    check every runtime requirement is met by the device or by a carried wheel.
"$PY" - "$DEST" "deepspeed==$DEEPSPEED" "${PINS[@]}" <<'PYEOF'
import os
import sys
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # a bare interpreter: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

dest, pins = sys.argv[1], dict(p.split("==") for p in sys.argv[2:])
pins = {canonicalize_name(n): Version(v) for n, v in pins.items()}
# The device's packages that these wheels' requirements touch (python3 -m pip list, 2026-11);
# a name with version None is there but was not read.
device = dict(
    accelerate="1.15.0", aiohttp="3.14.3", anyio="4.15.1", click="8.5.0", einops="0.8.2",
    filelock="3.32.5", fsspec="2026.7.0", httpx="0.28.1", huggingface_hub="1.33.0",
    jinja2="3.1.6", msgpack="1.2.3", ninja="1.13.2", numpy="2.5.2", nvidia_ml_py="13.610.43",
    packaging="26.3", pandas="3.0.6", peft="0.21.0", protobuf="7.36.2", psutil="7.2.2",
    py_cpuinfo="9.0.0", pyarrow="25.0.1", pyyaml="6.0.3", requests="2.34.2", rich="15.0.0",
    safetensors="0.8.0", tokenizers="0.23.2", torch="2.11.0", tqdm="4.70.1",
    transformers="5.17.0", typing_extensions="4.16.0", urllib3="2.7.0", xxhash="4.0.1",
    zipp="4.1.0", wrapt="2.5.0", h11="0.16.0", certifi="2026.7.22", idna="3.19",
    charset_normalizer="3.5.1", frozenlist="1.8.0", markupsafe=None, pytest=None, sympy=None,
    networkx=None, triton=None, pillow=None, scipy=None, setuptools=None, wheel=None,
)
device = {canonicalize_name(n): v and Version(v) for n, v in device.items()}
env = dict(python_version="3.12", python_full_version="3.12.3", sys_platform="linux",
           platform_system="Linux", platform_machine="x86_64", implementation_name="cpython",
           platform_python_implementation="CPython", os_name="posix", extra="")

have, errors = {}, []
for f in sorted(os.listdir(dest)):
    if not f.endswith(".whl"):
        continue
    name, ver, _, _ = parse_wheel_filename(f)
    if pins.get(name) != ver:
        print(f"removing unpinned {f}")
        os.remove(os.path.join(dest, f))
        continue
    have[name] = (ver, os.path.join(dest, f))
errors += [f"missing wheel for {n}=={v}" for n, v in pins.items() if n not in have]
for name, (_, path) in have.items():
    with zipfile.ZipFile(path) as z:
        meta = next(m for m in z.namelist() if m.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1])
        if req.marker and not req.marker.evaluate(env):
            continue
        dep = canonicalize_name(req.name)
        ver = have[dep][0] if dep in have else device.get(dep, "absent")
        if ver == "absent":
            errors.append(f"{name} needs {req}: not on the device and not carried")
        elif ver is not None and not req.specifier.contains(ver, prereleases=True):
            errors.append(f"{name} needs {req}, but {dep} is {ver}")
size = sum(os.path.getsize(p) for _, p in have.values())
print(f"{len(have)} wheels, {size / 2**20:.1f} MiB in {dest}/ (carry limit 64 MiB with the repo)")
if errors:
    sys.exit("\n".join(errors))
PYEOF

# 4. Where a CPython 3.12 is at hand, check the wheels' tags install there (the device's --target
#    install, minus torch and its friends, so this checks installability, not imports).
PY312=
for cand in ${PY312_CANDIDATE:-} python3.12 "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
    if "$cand" -m pip --version >/dev/null 2>&1; then PY312=$cand; break; fi
done
if [ -n "$PY312" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$PY312" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$tmp" "$DEST"/*.whl
    echo "installs into a CPython 3.12 --target ($PY312): ok"
fi
