"""Training arguments for the CPU tests that train the tiny toy Llama with a Trainer or a TRL
trainer (test_model_card.py, test_integration_trl.py, test_integration_trainer.py).

`cpu_training_args` gives the settings of a quiet, deterministic few-step run in one CPU
process: fp32 (TRL's configs default ``bf16`` to True even on CPU; the Trainer's default is
already False), a log every step, nothing reported or saved, no dataloader workers or pinned
memory, no progress bar, a fixed seed. `ADAMW_REFERENCE` is the optimizer setting of the runs
compared against torch's AdamW (``optim="adamw_torch"``); ``adam_epsilon=1e-6`` is explained in
the docstrings of those tests. `no_checkpointing` turns activation checkpointing off (TRL's
configs default it to on) under the name this transformers gives it.
"""

from __future__ import annotations

from hf_superoffload.recipes.arguments import checkpointing_name

SEED = 0

ADAMW_REFERENCE = {
    "learning_rate": 1e-3,
    "lr_scheduler_type": "linear",
    "warmup_steps": 2,
    "weight_decay": 0.1,
    "adam_epsilon": 1e-6,
    "max_grad_norm": 1.0,
    "optim": "adamw_torch",
}


def cpu_training_args(output_dir, **overrides) -> dict:
    """Keyword arguments of a `TrainingArguments` (or a subclass: SuperOffload's, TRL's
    configs) for a tiny CPU run writing to ``output_dir``; ``overrides`` win."""
    kwargs = {
        "output_dir": str(output_dir),
        "bf16": False,
        "logging_steps": 1,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
        "disable_tqdm": True,
        "seed": SEED,
    }
    kwargs.update(overrides)
    return kwargs


def no_checkpointing(config_cls) -> dict:
    """Activation checkpointing off, under the name ``config_cls`` knows (transformers renamed
    ``gradient_checkpointing`` to ``activation_checkpointing``)."""
    return {checkpointing_name(config_cls): False}
