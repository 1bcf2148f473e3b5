"""What the user docs and help texts claim agrees with the shipped files and the measured runs:
the DeepSpeed snippets use the ``super_offload`` value the shipped config uses, the ``cast``
help quotes the run log's figures, and the README states the NaN/Inf skip as exactly as the
optimizer's docstring does."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from hf_superoffload.engine import optimizer as engine_optimizer
from hf_superoffload.integrations.plugin import SuperOffloadOptions

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "accelerate_configs" / "deepspeed" / "zero3_superoffload.json"
CAST_RUN_LOG = ROOT / "docs" / "runs" / "2026-11-24-lean-offload-h100.md"
SUPER_OFFLOAD_VALUE = re.compile(r'"super_offload":\s*("[^"]*"|true|false)')


def _shipped_value() -> str:
    config = json.loads(SHIPPED.read_text())
    return json.dumps(config["zero_optimization"]["offload_optimizer"]["super_offload"])


def test_deepspeed_snippets_use_the_shipped_configs_super_offload_value():
    shipped = _shipped_value()
    assert shipped == '"hf_superoffload"'
    for doc in ("README.md", "docs/usage.md"):
        blocks = (ROOT / doc).read_text().split("```")[1::2]  # the fenced ones
        values = [v for block in blocks for v in SUPER_OFFLOAD_VALUE.findall(block)]
        assert values and set(values) == {shipped}, f"{doc}: {values}"
    # Where recipes.md names the shipped JSON, it gives the value the JSON holds.
    recipes = (ROOT / "docs" / "recipes.md").read_text()
    named = re.search(r"zero3_superoffload\.json` \(`\"super_offload\": ([^`]+)`", recipes)
    assert named and named.group(1) == shipped


def test_cast_help_quotes_what_the_run_log_measured():
    field = {f.name: f for f in dataclasses.fields(SuperOffloadOptions)}["cast"]
    text = field.metadata["help"]
    assert "faster" not in text  # the copy-out ring's run measured cast='cpu' slower
    log = CAST_RUN_LOG.read_text()
    for figure in re.findall(r"\d\.\d{3}", text):
        assert figure in log, figure
    assert re.search(r"cast=cpu 1\.629 s, auto 1\.589 s", log)
    assert "1.629" in text and "1.589" in text


def test_readme_states_the_nonfinite_skip_as_the_optimizer_guarantees_it():
    row = next(
        line for line in (ROOT / "README.md").read_text().splitlines() if "| NaN/Inf" in line
    )
    assert "undone exactly" not in row
    doc = engine_optimizer.__doc__
    # The optimizer's two cases: bit-exact when the first bucket is non-finite, within the
    # rollback's rounding for buckets speculated before a later bad one.
    assert "bit-exact" in doc and "within the rollback's rounding" in doc
    assert "bit-exact" in row and "rolled back to within a few ulp" in row
