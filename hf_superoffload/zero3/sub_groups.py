"""How the ZeRO-3 path cuts a rank's partition into sub groups, the unit the STV core
speculates on: at most ``sub_group_size`` elements each, in DeepSpeed's param order (the
forward order, so the next forward's first layers settle first), and DeepSpeed's persistent
params (small ones it gathers again at the end of every step) in sub groups of their own, so
that this gather waits only for them. Mixed in before DeepSpeedZeroOptimizer_Stage3, whose
constructor calls ``_create_fp16_sub_groups``.

DeepSpeed's own cut of the same params is kept beside ours (``norm_sub_groups``): the global
gradient norm is combined from per sub group norms, and rounds by the cut (norms.py).
"""

from __future__ import annotations

from .sub_group_cut import cut_sub_groups


class SubGroupLayout:
    def _create_fp16_sub_groups(self, params_group):
        """Sub groups of at most ``sub_group_size`` elements of this rank's partition, with
        the persistent params (gathered again at every step's end) in sub groups of their
        own, so that gather waits only for them: ``sub_group_cut``'s rule, which the memory
        plan and the host check count by. DeepSpeed's cut of the group, at the size DeepSpeed
        would cut at (``norm_sub_group_size``: the config's, else DeepSpeed's default, where
        ours is 2**25), goes to ``norm_sub_groups`` (which the optimizer's constructor makes
        empty)."""
        ours, self.sub_group_size = self.sub_group_size, self.norm_sub_group_size
        try:
            self.norm_sub_groups.extend(super()._create_fp16_sub_groups(params_group))
        finally:
            self.sub_group_size = ours
        return cut_sub_groups(
            params_group,
            self.sub_group_size,
            numel=lambda p: p.partition_numel(),
            persistent=lambda p: getattr(p, "ds_persist", False),
        )

    def _holds_persistent(self, sub_group: int) -> bool:
        return any(getattr(p, "ds_persist", False) for p in self.fp16_groups[sub_group])
