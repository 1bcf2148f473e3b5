"""Variables of the standalone path that the ZeRO-3 path does not read are refused there, by
name and with what to do instead, when DeepSpeed builds the optimizer (before any state)."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.zero3.options import resolve_options

CPU = torch.device("cpu")


@pytest.mark.parametrize("value", ["bfloat16", "float32"])
def test_the_save_dtype_variable_is_refused_under_zero3(monkeypatch, value):
    """HF_SUPEROFFLOAD_SAVE_DTYPE sets what the standalone trainers save; under ZeRO-3 a save
    writes the 16-bit weights whatever it says (as superoffload_save_dtype, which the trainers
    refuse there), so even its default value is refused rather than ignored."""
    monkeypatch.setenv("HF_SUPEROFFLOAD_SAVE_DTYPE", value)
    with pytest.raises(ValueError) as refusal:
        resolve_options(None, CPU)
    message = str(refusal.value)
    assert f"HF_SUPEROFFLOAD_SAVE_DTYPE={value} applies to the standalone engine" in message
    assert "zero_to_fp32" in message and "Unset HF_SUPEROFFLOAD_SAVE_DTYPE" in message


def test_without_the_variable_the_options_resolve(monkeypatch):
    monkeypatch.delenv("HF_SUPEROFFLOAD_SAVE_DTYPE", raising=False)
    monkeypatch.setenv("HF_SUPEROFFLOAD_CAST", "cpu")
    assert resolve_options(None, CPU).cast == "cpu"
