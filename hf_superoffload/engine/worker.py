"""An in-process worker thread that runs CPU optimizer tasks in order.

Threads, not processes: tasks share tensors with the training thread (no pickling, pinned
buffers stay pinned), and the kernels release the GIL. Each task names the buckets it touches;
``wait`` blocks until those buckets have no queued or running task. An exception in a task
stops the worker (the tasks queued after it never run) and is re-raised, as ``WorkerError``,
by the next ``submit``, ``wait`` or ``raise_if_failed``, whatever they name; with other
data-parallel ranks it is also published for them (``replicas.publish_failure``). ``close``
raises it too unless a caller was told already: a failure is never lost, and closing is how
one recovers from a failure already seen.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

import torch

from .core_split import pin_cpu_adam_thread
from .replicas import publish_failure

_STOP = object()


class WorkerError(RuntimeError):
    """The optimizer worker failed; the original exception is the ``__cause__``.

    The optimizers raise it at their first call after the failure (zero_grad(), the next
    forward's first module, a gradient in backward, step(), a state read, close()). What the
    failure leaves (tests/test_worker_failure_surfaces.py): each bucket's params in the model
    hold its last update that the worker completed, or, for a bucket whose update was under
    way (speculated in backward, replayed or rolled back after step()), part of it. A failed
    early write of compact moments changes no param: they hold the update of the step() it
    followed, and no later task runs. No param the optimizer trains keeps a gradient of the
    call that raised it. Its master weights and moments may lack updates; nothing reads them
    again. Either close() it and build a new optimizer over the model, which trains from the
    params as they are, or resume from the last checkpoint."""


class Worker:
    def __init__(self, name: str = "hf_superoffload-worker"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: dict[int, int] = {}
        self._error: BaseException | None = None
        self._told = False  # the error was raised in some caller's thread
        self._closed = False
        # Tells the other ranks of a failed task: the optimizer passes its replicas' (scoped to
        # it); the default publishes for the latest optimizer built.
        self.publish: Callable[[BaseException], None] = publish_failure
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        pin_cpu_adam_thread(self._thread.native_id)  # before any task: OpenMP's team inherits

    def submit(self, buckets: Iterable[int], task: Callable[[], None]) -> None:
        keys = tuple(buckets)
        with self._cond:
            self._raise_if_failed()
            if self._closed:
                raise RuntimeError("the optimizer was closed; create a new one to keep training.")
            for key in keys:
                self._pending[key] = self._pending.get(key, 0) + 1
        self._tasks.put((keys, task))

    def wait(self, buckets: Iterable[int] | None = None) -> None:
        """Block until the given buckets (default: all) have no outstanding task."""
        keys = None if buckets is None else tuple(buckets)
        with self._cond:
            while True:
                self._raise_if_failed()
                pending = (
                    self._pending.values()
                    if keys is None
                    else (self._pending.get(k, 0) for k in keys)
                )
                if not any(pending):
                    return
                self._cond.wait()

    def busy(self, buckets: Iterable[int]) -> bool:
        """Whether these buckets have a queued or running task (a failed one stays queued);
        a query only: ``raise_if_failed`` says whether the worker failed."""
        with self._cond:
            return any(self._pending.get(k, 0) for k in buckets)

    def raise_if_failed(self) -> None:
        """Raise the failure of a task, if one failed (``WorkerError``, or KeyboardInterrupt)."""
        with self._cond:
            self._raise_if_failed()

    def close(self) -> None:
        """Stop the thread once the tasks queued so far have run (idempotent, and it never
        waits for more). Then raise a failure no caller has been told of: one of those tasks
        (a final flush of state) or an earlier one nobody waited for since."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._tasks.put(_STOP)
        if threading.current_thread() is self._thread:
            return  # a finalizer run on the worker: it stops after this task
        self._thread.join()
        with self._cond:
            if not self._told:
                self._raise_if_failed()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """Whether tasks submitted now would run: not closed, no task failed."""
        with self._cond:
            return not self._closed and self._error is None and self._thread.is_alive()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self._told = True
        if isinstance(self._error, KeyboardInterrupt):
            # An interrupt stays an interrupt (a notebook's stop button, a Trainer's handler).
            raise KeyboardInterrupt(
                "the SuperOffload CPU worker was interrupted; close() this optimizer and build "
                "a new one."
            ) from self._error
        if self._error is not None:
            raise WorkerError(
                f"the SuperOffload CPU worker failed: {self._error!r}. This optimizer cannot "
                f"go on: close() it and build a new one (resume from the last checkpoint)."
            ) from self._error

    def _run(self) -> None:
        # Tasks update optimizer tensors in place (some are autograd leaves, e.g. DeepSpeed's
        # fp32 partitions); grad mode is per thread, so switch it off for this one.
        torch.set_grad_enabled(False)
        while True:
            item = self._tasks.get()
            if item is _STOP:
                return
            keys, task = item
            try:
                task()
            except BaseException as error:  # surfaced to the training thread by wait()/submit()
                self.publish(error)  # first: the other ranks' collectives break when it ends
                with self._cond:
                    self._error = error
                    self._cond.notify_all()
                return
            with self._cond:
                for key in keys:
                    self._pending[key] -= 1
                self._cond.notify_all()
