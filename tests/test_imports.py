"""``import hf_superoffload`` is light and silent: it loads no optional library (nor
transformers or accelerate), prints nothing, leaves stdout and stderr alone, and takes well
under a second beyond torch; the public names load their modules on first use, and the
DeepSpeed switch still patches DeepSpeed when DeepSpeed is imported after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("deepspeed", "trl", "wandb", "datasets", "matplotlib", "transformers", "accelerate")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", **env}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_import_loads_no_optional_library_prints_nothing_and_redirects_nothing():
    done = run_python(
        "import sys\n"
        "out, err = sys.stdout, sys.stderr\n"
        "import hf_superoffload\n"
        "assert sys.stdout is out and sys.stderr is err, 'stdout or stderr replaced'\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "sys.stdout.write('LOADED=' + repr(loaded))\n"
    )
    assert done.stdout == "LOADED=[]"  # nothing else printed, nothing loaded
    assert done.stderr == ""


def test_import_time_beyond_torch():
    """Measured 0.2 s on an idle 2-core machine; the bound leaves room for a loaded CI core."""
    done = run_python(
        "import time\n"
        "start = time.perf_counter()\n"
        "import torch\n"
        "after_torch = time.perf_counter()\n"
        "import hf_superoffload\n"
        "end = time.perf_counter()\n"
        "print(after_torch - start, end - after_torch)\n"
    )
    torch_s, package_s = map(float, done.stdout.split())
    print(f"import torch {torch_s:.2f} s, then import hf_superoffload {package_s:.2f} s")
    assert package_s < 3.0


def test_public_names_load_on_first_use():
    done = run_python(
        "import sys, json, hf_superoffload as h\n"
        "from hf_superoffload import SuperOffloadOptimizer, SuperOffloadOptions\n"
        "light = 'transformers' not in sys.modules\n"
        "names = {n: getattr(h, n).__module__ for n in h.__all__ if n != '__version__'}\n"
        "print(json.dumps({'light': light, 'names': names, 'dir': dir(h)}))\n"
    )
    found = json.loads(done.stdout.splitlines()[-1])  # transformers may print a line first
    assert found["light"], "the optimizer and its options alone loaded transformers"
    assert found["names"] == {
        "SuperOffloadOptimizer": "hf_superoffload.engine.optimizer",
        "SuperOffloadOptions": "hf_superoffload.integrations.plugin",
        "SuperOffloadTrainingArguments": "hf_superoffload.integrations.arguments",
        "SuperOffloadTrainer": "hf_superoffload.integrations.trainer",
        "SuperOffloadTrainerMixin": "hf_superoffload.integrations.trainer",
        "SuperOffloadSFTConfig": "hf_superoffload.integrations.trl",
        "SuperOffloadSFTTrainer": "hf_superoffload.integrations.trl",
        "SuperOffloadDPOConfig": "hf_superoffload.integrations.trl",
        "SuperOffloadDPOTrainer": "hf_superoffload.integrations.trl",
    }
    assert set(found["names"]) <= set(found["dir"])


def test_an_unknown_name_is_an_attribute_error():
    import hf_superoffload

    with pytest.raises(AttributeError, match="SuperOffloadNothing"):
        hf_superoffload.SuperOffloadNothing  # noqa: B018


def test_the_deepspeed_switch_patches_deepspeed_imported_afterwards():
    """The one-line switch: a script that imports the package and then DeepSpeed (through
    accelerate or the Trainer, or itself) gets this package's ZeRO-3 optimizer."""
    done = run_python(
        "import sys\n"
        "import hf_superoffload\n"
        "assert 'deepspeed' not in sys.modules\n"
        "from deepspeed.runtime.superoffload import superoffload_stage3 as target\n"
        "print(target.SuperOffloadOptimizer_Stage3.__module__)\n",
        DS_ACCELERATOR="cpu",
    )
    assert done.stdout.strip().splitlines()[-1] == "hf_superoffload.zero3.optimizer"
