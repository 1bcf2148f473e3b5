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

import sys

# Offline mode (HF_HUB_OFFLINE=1) for a run that needs nothing from the Hub: the demo, random
# weights on local data. It is decided before `huggingface_hub` is imported, which reads the
# variable once; a run that names a Hub model or dataset or pushes stays online, and a user's
# own setting wins (recipes/hub_access.py).
from hf_superoffload.recipes.hub_access import choose_offline_mode

choose_offline_mode(sys.argv[1:])

from hf_superoffload.recipes.run import main  # noqa: E402 (after the offline decision)

if __name__ == "__main__":
    sys.exit(main("dpo", sys.argv[1:]))
