"""The engine worker of `dflash serve`: one thread owns the session (the models and the decode loop) and serves a
bounded queue of jobs. HTTP handlers only submit jobs and read their updates; they never touch the models.

A `Job` is also what a batched engine will consume: prompt ids, sampling params, a cancel flag checked between
steps, and a `deliver` callback that receives the job's updates in order (text deltas, then one last update
with the finish reason and the generation's numbers). The worker decodes one job at a time today; decoding
several at once changes `Worker._serve` and `_next`, not the jobs or the handlers.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from dflash_cli.params import SamplingParams


@dataclass(frozen=True)
class Update:
    text: str = ""  # text to show, decoded and held back where a stop string may be starting
    tokens: int = 0  # tokens this update commits
    finish_reason: str | None = None  # on the last update: "stop", "length", "cancelled" or "error"
    stats: Any = None  # on the last update: the generation's engine GenerationStats (None if it never started)
    error: str | None = None  # with finish_reason "error": what went wrong


class Job:
    """One request for the engine. `deliver` is called from the worker thread."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, deliver: Callable[[Update], None]) -> None:
        self.id = uuid.uuid4().hex[:8]
        self.prompt_ids = prompt_ids
        self.params = params
        self.deliver = deliver
        self.submitted = time.perf_counter()
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()


class QueueFull(Exception):
    """Every queue slot is taken: the request is refused at once (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work (HTTP 503)."""


class Worker:
    """The thread that owns the engine. `max_queue` jobs may wait while one decodes; more are refused."""

    def __init__(
        self,
        session: Any,
        *,
        speculative: bool,
        max_queue: int,
        on_finish: Callable[[Job, Update, float], None] | None = None,
    ) -> None:
        self.session = session
        self.speculative = speculative
        self.max_queue = max_queue
        self.on_finish = on_finish  # (job, last update, seconds waited in the queue): metrics and the log
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._stopping = False
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="dflash-engine", daemon=True)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    @property
    def full(self) -> bool:
        """One job decodes and `max_queue` wait behind it (a job between submit and its start counts as waiting)."""
        return len(self._waiting) + self.running >= self.max_queue + 1

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise QueueFull / ShuttingDown at once: a client never waits to be refused."""
        with self._lock:
            if self._stopping:
                raise ShuttingDown
            if self.full:
                raise QueueFull
            self._waiting.append(job)
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        """Stop `job`: a waiting one leaves the queue now, a running one stops at its next step."""
        job.cancel()
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
            else:
                return
        self._finish(job, Update(finish_reason="cancelled"), 0.0)

    def stop(self) -> None:
        """Take no more work and cancel all of it; returns at once (join() waits for the thread)."""
        with self._lock:
            self._stopping = True
            dropped = list(self._waiting)
            self._waiting.clear()
            if self._running is not None:
                self._running.cancel()
            self._lock.notify_all()
        for job in dropped:
            job.cancel()
            self._finish(job, Update(finish_reason="cancelled"), 0.0)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._lock:
            while not self._waiting and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return None
            self._running = self._waiting.popleft()
            return self._running

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._generate(job)
            finally:
                with self._lock:
                    self._running = None

    def _send(self, job: Job, update: Update) -> None:
        try:
            job.deliver(update)
        except Exception:  # the reader is gone (its event loop closed): nobody to decode for
            job.cancel()

    def _finish(self, job: Job, update: Update, waited: float) -> None:
        self._send(job, update)
        if self.on_finish is not None:
            self.on_finish(job, update, waited)

    def _generate(self, job: Job) -> None:
        waited = time.perf_counter() - job.submitted
        stats = None
        try:
            steps = self.session.stream(job.prompt_ids, job.params, speculative=self.speculative)
            with closing(steps):  # stopping the step generator early is safe: it holds all the loop's state
                for step in steps:
                    stats = step.stats
                    if job.cancelled:
                        break
                    if step.finish_reason is not None:
                        final = Update(step.text, len(step.token_ids), step.finish_reason, copy.deepcopy(stats))
                        self._finish(job, final, waited)
                        return
                    self._send(job, Update(step.text, len(step.token_ids)))
        except Exception as error:  # one failing generation fails its request alone; the worker serves on
            traceback.print_exc()
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            self._finish(job, Update(finish_reason="error", error=message, stats=copy.deepcopy(stats)), waited)
            import torch  # loaded already: the session's models are torch models

            if isinstance(error, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()  # give the next request the memory this one could not use
            return
        self._finish(job, Update(finish_reason="cancelled", stats=copy.deepcopy(stats)), waited)
