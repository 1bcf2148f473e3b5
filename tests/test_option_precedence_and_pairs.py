"""Options resolve as documented (explicit > HF_SUPEROFFLOAD_* variable > default), the demo's
small bucket included, and a pair of options that would do nothing together is refused before
anything is built."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer, SuperOffloadOptions
from hf_superoffload.recipes import arguments

PAIR_REFUSAL = "speculate_after_clip=True has no effect with speculate=False"


@pytest.mark.parametrize(
    ("variable", "flag", "bucket"),
    [
        (None, None, arguments.DEMO_BUCKET_SIZE),  # the demo's default
        ("4096", None, 4096),  # the variable beats the demo's default
        ("4096", "8192", 8192),  # the flag beats both
    ],
)
def test_the_demo_bucket_gives_way_to_the_variable_and_the_flag(
    tmp_path, monkeypatch, variable, flag, bucket
):
    if variable is None:
        monkeypatch.delenv(arguments.BUCKET_SIZE_ENV, raising=False)
    else:
        monkeypatch.setenv(arguments.BUCKET_SIZE_ENV, variable)
    argv = ["--output_dir", str(tmp_path), "--bf16", "false"]
    if flag is not None:
        argv += ["--superoffload_bucket_size", flag]
    recipe, args = arguments.parse("sft", argv)
    assert recipe.demo
    assert args.superoffload_options().bucket_size == bucket


def test_speculate_after_clip_without_speculation_is_refused_as_keywords():
    model = torch.nn.Linear(8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=PAIR_REFUSAL):
        SuperOffloadOptimizer(
            model.parameters(), lr=1e-3, model=model, speculate=False, speculate_after_clip=True
        )
    for param, old in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(param, old, rtol=0, atol=0)
    with SuperOffloadOptimizer(model.parameters(), lr=1e-3, model=model, speculate=False):
        pass  # the same params take an optimizer with a pair that acts


def test_speculate_after_clip_without_speculation_is_refused_from_options_and_variables(
    monkeypatch,
):
    # SuperOffloadOptions is what the trainers, accelerate scripts and the ZeRO-3 path resolve.
    with pytest.raises(ValueError, match=PAIR_REFUSAL):
        SuperOffloadOptions(speculate=False, speculate_after_clip=True)
    monkeypatch.setenv("HF_SUPEROFFLOAD_SPECULATE", "0")
    monkeypatch.setenv("HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP", "1")
    with pytest.raises(ValueError, match="unset HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP"):
        SuperOffloadOptions()
    monkeypatch.delenv("HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP")
    assert SuperOffloadOptions().speculate is False  # speculation off alone is fine
