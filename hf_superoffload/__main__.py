"""``python -m hf_superoffload``: the same command line as ``hf-superoffload``."""

from .cli import main

raise SystemExit(main())
