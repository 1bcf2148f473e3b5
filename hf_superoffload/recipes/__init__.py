"""Training recipes driven by TRL's argument parser: the demo (``hf-superoffload demo``,
``examples/sft.py`` and ``examples/dpo.py`` with no arguments) and the paper's models
(``examples/recipes/*.yaml``), SFT and DPO, through the SuperOffload TRL trainers.

``run.main("sft", argv)`` is the whole job; ``arguments`` holds the command line, ``model`` the
model and tokenizer, ``data`` the training set, ``report`` the progress bar, loss curve and
summary, ``arithmetic`` the bundled data.
"""

from ..extras import require

# Checked before any recipe module loads: a missing one is named with its pip install at once,
# not after the model has loaded (matplotlib draws loss.png at the end of a run).
require("trl", "datasets", "matplotlib", purpose="the recipes and the demo")
