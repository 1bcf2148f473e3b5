"""The SuperOffload engine: speculation-then-validation CPU Adam with GPU tail buckets."""

from .optimizer import SuperOffloadOptimizer

__all__ = ["SuperOffloadOptimizer"]
