"""Training recipes driven by TRL's argument parser: the demo (``hf-superoffload demo``,
``examples/sft.py`` and ``examples/dpo.py`` with no arguments) and the paper's models
(``examples/recipes/*.yaml``), SFT and DPO, through the SuperOffload TRL trainers.

``run.main("sft", argv)`` is the whole job; ``arguments`` holds the command line, ``model`` the
model and tokenizer, ``data`` the training set, ``report`` the progress bar, loss curve and
summary, ``arithmetic`` the bundled data.
"""
