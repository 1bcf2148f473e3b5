"""Print setup.cfg's requirements pinned to their lower bounds (``name==lowest``), one a line:
what .ci/run's second environment installs, so that the lower bounds are the tested ones.

The hard requirements and the extras the CPU tier uses (deepspeed, trl, wandb, dev's own);
torch comes from the first environment (one version is supported) and torchao is for the GPU
benchmarks only.
"""

import configparser
from pathlib import Path

from packaging.requirements import Requirement

SKIP = {"torch", "torchao", "hf_superoffload"}
config = configparser.ConfigParser()
config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
sections = [config["options"]["install_requires"]]
extras = config["options.extras_require"]
sections += [extras[name] for name in ("deepspeed", "trl", "wandb", "dev")]
pins = {}
for section in sections:
    for line in section.strip().splitlines():
        requirement = Requirement(line)
        if requirement.name in SKIP:
            continue
        lowest = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        pins[requirement.name] = f"{requirement.name}=={lowest[0]}"
print("\n".join(sorted(pins.values())))
