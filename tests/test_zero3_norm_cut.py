"""The ZeRO-3 global norm is combined over DeepSpeed's own cut of the sub groups (norms.py),
at the size DeepSpeed cuts at: the config's ``sub_group_size``, or DeepSpeed's default where
the config leaves it out, while the optimizer's own sub groups are cut at 2**25 then
(options.resolve_sizes). The end-to-end norms are compared with DeepSpeed's in
tests/test_zero3.py."""

from __future__ import annotations

from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from hf_superoffload.zero3.sub_groups import SubGroupLayout


class _Param:
    def __init__(self, numel: int):
        self.numel = numel

    def partition_numel(self) -> int:
        return self.numel


class _Layout(SubGroupLayout, DeepSpeedZeroOptimizer_Stage3):
    def __init__(self, ours: int, deepspeeds: int):  # none of DeepSpeed's constructor
        self.sub_group_size, self.norm_sub_group_size = ours, deepspeeds
        self.norm_sub_groups = []


def test_the_norm_follows_deepspeeds_cut_at_deepspeeds_size():
    params = [_Param(n) for n in (6, 6, 6, 6, 1)]
    layout = _Layout(ours=10, deepspeeds=1_000_000_000)  # a config without sub_group_size
    ours = layout._create_fp16_sub_groups(params)
    assert [len(g) for g in ours] == [1, 1, 1, 2]  # at most 10 elements each
    assert layout.norm_sub_groups == [params]  # DeepSpeed's default: one group
    assert layout.sub_group_size == 10  # ours again afterwards

    written = _Layout(ours=12, deepspeeds=12)  # the config's size: both cut at it
    written._create_fp16_sub_groups(params)
    expected = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(written, params)
    assert written.norm_sub_groups == expected == [params[:2], params[2:4], params[4:]]
