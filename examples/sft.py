# Run (from the repository root, with the package installed: pip install -e ".[trl]"):
#   python examples/sft.py                                   # the demo: tiny Llama, bundled data
#   python examples/sft.py --max_steps 200 --output_dir outputs/sft-long
#   python examples/sft.py --config examples/recipes/qwen3-14b.yaml --model_name_or_path Qwen/Qwen3-14B
#   python examples/sft.py --help                            # every argument (TRL's and superoffload_*)
"""Supervised fine-tuning with TRL's SFTTrainer and SuperOffload (fp32 master weights and Adam
state in CPU memory, stepped during backward).

Arguments are TRL's: ``--config recipe.yaml`` (examples/recipes/) and command-line overrides of
any SFTConfig, TrainingArguments or ``superoffload_*`` field, plus the script's own
(``--model_name_or_path``, ``--random_init_from_config``, ``--dataset_path``, ...).

With no model named it runs the demo, which needs no download: a tiny random Llama, the
character tokenizer of ``hf_superoffload.toy`` and the bundled arithmetic data
(``examples/data/arithmetic_sft.jsonl``'s rows), in under a minute on two CPU cores (bf16 on a
GPU when one is visible). It shows a progress bar, saves the model, a model card (README.md)
and the loss curve (loss.png) to ``--output_dir``, prints a summary, and exits non-zero if the
loss did not go down. ``hf-superoffload demo`` runs the same job.
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
    sys.exit(main("sft", sys.argv[1:]))
