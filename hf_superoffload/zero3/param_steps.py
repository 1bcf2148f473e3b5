"""Per-param step bookkeeping of a ZeRO-3 sub group: which of its params got a gradient this
step, and each param's own step count.

A param without a gradient in a step is not updated at all, as torch's AdamW skips a param
whose ``grad`` is None: no weight decay, no moment decay, no step count. (DeepSpeed's plain
CPU offload steps such a param from whatever its fp32 gradient buffer last held: zero before
its first gradient, its last gradient, already clipped, after.) So the params of one sub
group may be at different step counts; the base optimizer's ``step`` of the sub group is the
largest, and ``param_steps`` in its state holds all of them while they differ.
"""

from __future__ import annotations

import torch

PARAM_STEPS_KEY = "param_steps"


class ParamSteps:
    """Mixed into a HostPartition of a ZeRO-3 sub group: ``spans`` are its params' (offset,
    numel) in the flat partition (this rank's partition of each, padding included)."""

    def init_param_steps(self, spans: list[tuple[int, int]]) -> None:
        self.spans = spans
        self.param_steps = [0] * len(spans)
        self.present = [True] * len(spans)  # got a gradient this step (set at each launch)

    @property
    def param_count(self) -> int:
        return len(self.spans)

    def param_step(self, param_index: int) -> int:
        return self.param_steps[param_index]

    def views(self, tensor: torch.Tensor, param_index: int) -> torch.Tensor:
        offset, numel = self.spans[param_index]
        return tensor.narrow(0, offset, numel)

    def update_runs(self) -> list[tuple[int, int, int]]:
        """The (offset, numel, update number) runs of this step: params with a gradient, each
        at its own next step count, neighbours that share one merged."""
        steps = self.param_steps
        if all(self.present) and min(steps, default=0) == max(steps, default=0):
            return [(0, self.numel, self.step + 1)]
        runs: list[tuple[int, int, int]] = []
        for (offset, numel), present, step in zip(self.spans, self.present, steps, strict=True):
            if not present or numel == 0:
                continue
            if runs and runs[-1][0] + runs[-1][1] == offset and runs[-1][2] == step + 1:
                runs[-1] = (runs[-1][0], runs[-1][1] + numel, step + 1)
            else:
                runs.append((offset, numel, step + 1))
        return runs

    def commit_update(self) -> None:
        for i, present in enumerate(self.present):
            self.param_steps[i] += present
        self.step = max(self.param_steps)

    def save_steps(self, state: dict, step_value) -> None:
        """Into the base optimizer's state of the sub group: ``step`` (the largest), and the
        per-param counts only while they differ (checkpoints stay DeepSpeed's otherwise)."""
        state["step"] = step_value(self.step)
        if min(self.param_steps, default=0) != max(self.param_steps, default=0):
            state[PARAM_STEPS_KEY] = torch.tensor(self.param_steps, dtype=torch.float64)
        else:
            state.pop(PARAM_STEPS_KEY, None)

    def load_steps(self, state: dict) -> None:
        """From a loaded state: without per-param counts every param is at ``step`` (a
        checkpoint of DeepSpeed's own offload, or one where they did not differ)."""
        self.step = int(state["step"])
        saved = state.get(PARAM_STEPS_KEY)
        if saved is None:
            self.param_steps = [self.step] * len(self.spans)
        else:
            steps = [int(s) for s in saved.tolist()]
            if len(steps) != len(self.spans):
                raise ValueError(
                    f"the checkpoint's {PARAM_STEPS_KEY} of sub group {self.index} has "
                    f"{len(steps)} entries for {len(self.spans)} params: it was saved with "
                    "another sub_group_size or model; load it with the config that saved it."
                )
            self.param_steps = steps
