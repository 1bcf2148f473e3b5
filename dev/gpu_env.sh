# Source at the start of every command on a GPU machine without network, from the repo root:
#
#   source dev/gpu_env.sh && python benchmarks/cpu_adam.py --threads 16
#
# with `.whl/` copied there beside the checkout (fill it first, on a machine with network, with
# dev/prepare_wheels.sh). It installs those wheels into /tmp/site (--no-deps: the GPU
# machine's own torch 2.11 and friends stay), puts /tmp/site and the repo on PYTHONPATH, sets the
# environment every GPU run needs, and prints one line of versions.
# It is sourced, so it returns (never exits) on failure: `source ... && cmd` skips cmd then.

_dev_site=/tmp/site
if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_env: no .whl/*.whl in $PWD: run dev/prepare_wheels.sh and carry .whl" >&2
    return 1
fi
# A warm machine keeps /tmp/site between calls: reinstall only when the carried wheels changed.
_dev_stamp=$(ls -l .whl/*.whl | md5sum | cut -d' ' -f1)
if [ "$(cat "$_dev_site/.wheels.md5" 2>/dev/null)" != "$_dev_stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$_dev_site" .whl/*.whl || { echo "gpu_env: wheel install failed" >&2; return 1; }
    echo "$_dev_stamp" > "$_dev_site/.wheels.md5"
fi
unset _dev_stamp

export PYTHONPATH="$_dev_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$_dev_site/bin:$PATH"
unset _dev_site
# NVLink multicast stays off on shared multi-GPU hosts: keep these set in every launcher.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
# No network there: wandb logs to ./wandb offline, the Hub and datasets read the local cache only.
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

python3 - <<'PYEOF' || return 1
import platform
from importlib.metadata import PackageNotFoundError, version

import torch


def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"


if torch.cuda.is_available():
    n = torch.cuda.device_count()
    gpu = f"{n}x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
else:
    gpu = "none"
print(f"gpu_env: python {platform.python_version()} | torch {torch.__version__} | "
      f"transformers {v('transformers')} | trl {v('trl')} | deepspeed {v('deepspeed')} | "
      f"gpu {gpu}")
PYEOF
