"""Compact moments on the engine's CUDA path (side streams, page-locked buffers, the GPU tail
stepping the compact update on the device) against the plain-PyTorch compact reference on the
same GPU, bit for bit. Run on the device machine: ``python -m pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from compact_reference import assert_equal_trajectory, run_compact_reference
from engine_reference import RunConfig, clip_threshold, run_superoffload

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("gpu_tail", [0, 2], ids=["host", "gpu-tail"])
def test_compact_engine_on_gpu_equals_its_reference(gpu_tail):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = RunConfig(steps=12, two_groups=True, schedule="warmup_decay")
    cfg = cfg.replace(
        max_grad_norm=clip_threshold(cfg, "some", "cuda"),
        inject=((5, "model.layers.0.mlp.up_proj.weight", "nan"),),
    )
    got = run_superoffload(cfg, "cuda", moments="compact", gpu_tail=gpu_tail)
    assert got.stats["gpu_tail_buckets"] == gpu_tail
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms, "cuda"))


@pytest.mark.parametrize("early", [True, False], ids=["early", "fused"])
def test_compact_engine_on_gpu_writes_each_validated_update_in_the_next_pass(early, monkeypatch):
    """No clipping: each step's validated update is written right after validation, during
    the next forward (the default with a GPU: DeferredCommits.commit_early), or by the next
    step's speculative pass, fused with it, while that step's gradients land in a gradient
    slot (page-locked, copied on the D2H stream); a NaN step and the final state read write
    it on their own."""
    from test_compact_deferred import _commit_early

    _commit_early(monkeypatch, 0.0, early)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = RunConfig(steps=8, max_grad_norm=None)
    cfg = cfg.replace(inject=((5, "model.layers.0.mlp.up_proj.weight", "nan"),))
    got = run_superoffload(cfg, "cuda", moments="compact", gpu_tail=0)
    assert (got.stats["commits_fused"] > 0) != early
    assert got.stats["commit_seconds"] > 0
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms, "cuda"))
