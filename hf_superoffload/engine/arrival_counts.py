"""Which gradient arrival is a param's last of the step: the counting half of gradient
arrival (``grad_arrival.GradArrival`` stages and launches; this says when).

By default a param's step ends at its ``gradient_accumulation_steps``-th arrival. Told the
boundary (``set_boundary``, as the Trainer does), only the announced last backward pass ends
it, at its first arrival there. Either count can be wrong: a second ``backward()`` nobody
announced, or a hook firing twice in one backward (a shared weight under reentrant
checkpointing) brings more. The arrival part then reopens the bucket (a rollback), and
``learn`` makes later steps expect as many: counted per step when nobody said when the last
arrives, per boundary pass when the boundary was announced. Replicas cannot reopen a bucket
already averaged with the other ranks, so they learn from their first step instead, which
launches every bucket at step(): the counts agreed over the ranks (the largest), so every
rank launches each bucket after the same arrival.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .replicas import Replicas

logger = logging.getLogger("hf_superoffload")


class ArrivalCounts:
    """Arrivals of each param (by ``id``) this step and in the announced pass, and the
    arrivals per step (or per boundary pass) learned so far."""

    def __init__(self, keys: Iterable[int], accumulation_steps: int, learning: bool):
        self.accumulation_steps = accumulation_steps
        self.boundary: bool | None = None  # set_boundary's last word (None: count arrivals)
        # The first step launches every bucket at step() and learns from it (replicas).
        self.learning = learning
        self._step = dict.fromkeys(keys, 0)  # arrivals this step
        self._pass: dict[int, int] = {}  # arrivals in the announced backward pass
        self._per_step: dict[int, int] = {}  # learned arrivals per step
        self._per_boundary_pass: dict[int, int] = {}  # learned arrivals per boundary pass
        self._told = False

    @property
    def any(self) -> bool:
        """Whether some gradient arrived since the step began."""
        return any(self._step.values())

    @property
    def expects_many(self) -> bool:
        """More than one arrival per step may come (declared, announced or learned)."""
        declared = self.accumulation_steps > 1 or self.boundary is False
        return declared or self.learning or bool(self._per_step or self._per_boundary_pass)

    def set_boundary(self, is_boundary: bool | None) -> None:
        self.boundary = is_boundary
        self._pass.clear()  # a new backward pass is announced

    def arrive(self, key: int) -> bool:
        """Count an arrival for param ``key``; whether it is the param's last of the step."""
        self._step[key] += 1
        self._pass[key] = self._pass.get(key, 0) + 1
        if self.boundary is None:
            return self._step[key] >= self._per_step.get(key, self.accumulation_steps)
        if self.boundary:  # the window's last pass: its last arrival, as learned (once)
            return self._pass[key] >= self._per_boundary_pass.get(key, 1)
        return False

    def reset(self) -> None:
        """The step is over (or its gradients discarded)."""
        self._step = dict.fromkeys(self._step, 0)
        self._pass.clear()

    def learn(self, reopened: bool, replicas: Replicas) -> None:
        """After a step that reopened buckets (gradients came after their bucket launched),
        or the replicas' first step: expect as many arrivals from now on."""
        learning = self.learning and self.boundary is not False
        if not (reopened or learning) or self.boundary is False:
            return
        self.learning = False
        if self.boundary:
            counts, learned_so_far, expected = self._pass, self._per_boundary_pass, 1
        else:
            counts, learned_so_far = self._step, self._per_step
            expected = self.accumulation_steps
        if learning:
            keys = list(self._step)
            agreed = replicas.maxima([counts.get(k, 0) for k in keys])
            counts = dict(zip(keys, agreed, strict=True))
        learned = {k: n for k, n in counts.items() if n > learned_so_far.get(k, expected)}
        if not learned:
            return
        learned_so_far.update(learned)
        if self.boundary:
            logger.info(
                "hf_superoffload: a gradient hook fired %d times in one announced last "
                "backward pass (a shared weight under reentrant checkpointing, say), after its "
                "bucket had left for the CPU: that step's speculation was rolled back and the "
                "gradients summed. Later boundary passes expect as many.",
                max(learned.values()),
            )
            return
        if not self._told:
            self._told = True
            logger.info(
                "hf_superoffload: gradients arrived %d times per step() for some params after "
                "their bucket had left for the CPU: the early speculative update was rolled "
                "back before the next forward read the params, and the gradients were summed "
                "(the step equals AdamW's on the sum). Later steps expect as many arrivals; "
                "pass gradient_accumulation_steps=<backward calls per step> or call "
                "set_accumulation_boundary() before each backward to skip that rollback.",
                max(learned.values()),
            )
