"""hf_superoffload: SuperOffload (speculation-then-validation CPU-offloaded Adam) for Hugging Face."""

__version__ = "0.1.0"

from .engine import SuperOffloadOptimizer

__all__ = ["SuperOffloadOptimizer", "__version__"]
