# Run (from the repository root, with the package installed: pip install -e ".[trl]"):
#   python examples/dpo.py                                   # the demo: tiny Llama, bundled pairs
#   python examples/dpo.py --model_name_or_path outputs/sft-tiny-llama   # DPO after the SFT demo
#   python examples/dpo.py --help                            # every argument (TRL's and superoffload_*)
"""Direct preference optimization with TRL's DPOTrainer and SuperOffload (the policy's fp32
master weights and Adam state in CPU memory; the reference model takes no step).

Arguments are TRL's, as for ``examples/sft.py``: ``--config recipe.yaml`` and overrides of any
DPOConfig, TrainingArguments or ``superoffload_*`` field, plus the script's own.

With no model named it runs the DPO demo without any download: a tiny random Llama, the
character tokenizer of ``hf_superoffload.toy`` and the bundled preference pairs
(``examples/data/arithmetic_dpo.jsonl``'s rows: the right answer chosen, a near miss rejected).
``hf-superoffload demo --dpo`` runs the same job.
"""

import os
import sys

# The demo and the random-weight recipes need nothing from the Hub; offline, `datasets` and the
# trainers skip look-ups (and their waits on a machine without network). It must be set before
# `huggingface_hub` is imported. A user's setting wins: HF_HUB_OFFLINE=0 to download a model
# or dataset named by --model_name_or_path or --dataset_name.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_superoffload.recipes.run import main

if __name__ == "__main__":
    sys.exit(main("dpo", sys.argv[1:]))
