"""A failure on one rank of the streamed ZeRO-3 save (``streaming_save.py``), made every rank's.

Only rank 0 writes, but every rank joins each param's gather. Were rank 0 to raise out of the
save at its first failed write (a full disk, say), the others would wait in the next gather
until the collective's timeout, with an error that is not rank 0's. So a rank keeps its first
error, does no more of its own work but goes on joining the gathers, and at the end all ranks
agree: each raises its own error, or one naming the rank that failed and why.
"""

from __future__ import annotations

import torch.distributed as dist


class SaveErrors:
    """The first exception this rank met during the save."""

    def __init__(self):
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def attempt(self, work, *args, **kwargs):
        """``work(*args, **kwargs)`` unless an earlier step failed; its exception is kept
        (and None returned) instead of raised."""
        if self.error is not None:
            return None
        try:
            return work(*args, **kwargs)
        except Exception as error:  # raised again by raise_on_every_rank, on this rank
            self.error = error
            return None

    def raise_on_every_rank(self) -> None:
        """Collective (every rank calls it, after its last gather): raises this rank's error,
        else a RuntimeError naming another rank's; returns on every rank when none failed.
        It is also the save's closing barrier: no rank returns before rank 0 has written."""
        if not dist.is_initialized():
            if self.error is not None:
                raise self.error
            return
        mine = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        everyone: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if self.error is not None:
            raise self.error
        failures = [(rank, message) for rank, message in enumerate(everyone) if message]
        if failures:
            rank, message = failures[0]
            raise RuntimeError(
                f"the streamed ZeRO-3 model save failed on rank {rank} ({message}); this rank "
                f"stopped with it: see rank {rank}'s error for the cause"
            )
