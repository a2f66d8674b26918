"""The engine worker of `dflash serve`: one thread owns the session (the models and the decode loop) and serves a
bounded queue of jobs. HTTP handlers only submit jobs and read their updates; they never touch the models.

A `Job` is one request for the engine: prompt ids, sampling params, a cancel flag checked between steps, and a
`deliver` callback that receives the job's updates in order (text deltas, then one last update with the finish
reason and the generation's numbers). The worker decodes up to `session.batch_size` jobs at once, each a row of
one `engine.Batch` (continuous batching): between steps, waiting jobs join the free rows, and a finished or
cancelled job leaves its row at once. Each job's updates are its own row's steps.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from dflash_cli.protocol.params import SamplingParams


@dataclass(frozen=True)
class Update:
    text: str = ""  # text to show, decoded and held back where a stop string may be starting
    token_ids: tuple[int, ...] = ()  # the tokens this update commits
    finish_reason: str | None = None  # on the last update: "stop", "length", "cancelled" or "error"
    stats: Any = None  # on the last update: the generation's engine GenerationStats (None if it never started)
    error: str | None = None  # with finish_reason "error": what went wrong
    cached_tokens: int = 0  # the prompt tokens read from its slot (prefix reuse), known from the first update


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


class EngineThread:
    """The one thread that runs the model: it loads the session, then serves (`Worker`). One thread for both because
    OpenMP gives every thread that starts parallel work a pool of its own, and with two pools on the cores libgomp
    stops spinning between parallel regions: measured on 2 cores, a one-row int4 product took 35 us from one thread
    and 102 us from a second thread once the first had run parallel work (the demo served at 23 tok/s, not 100)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, done = call
            try:
                done.set_result(fn())
            except BaseException as error:  # handed to whoever waits on the call
                done.set_exception(error)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        done: Future[Any] = Future()
        self._calls.put((fn, done))
        return done

    def run(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on this thread; its result, or what it raised."""
        return self.submit(fn).result()

    def close(self) -> None:
        """End the thread once what it runs now returns."""
        self._calls.put(None)


class Worker:
    """Serves on the engine's thread. `session.batch_size` jobs decode together and `max_queue` more may wait;
    more are refused."""

    def __init__(
        self,
        session: Any,
        engine: EngineThread,
        *,
        speculative: bool,
        max_queue: int,
        on_finish: Callable[[Job, Update, float], None] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        self.session = session
        self.speculative = speculative
        self.max_queue = max_queue
        self.rows = session.batch_size
        self.on_finish = on_finish  # (job, last update, seconds waited in the queue): metrics and the log
        self.on_step = on_step  # (rows that shared a verify step): metrics
        self._waiting: deque[Job] = deque()
        self._running: dict[Job, Any] = {}  # job -> its engine.Row
        self._waited: dict[Job, float] = {}
        self._stopping = False
        self._lock = threading.Condition()
        self._engine = engine
        self._serving: Future[Any] | None = None  # the serve loop's run on the engine's thread, once started

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def full(self) -> bool:
        """Every row decodes and `max_queue` wait (a job between submit and its start counts as waiting)."""
        return len(self._waiting) + self.running >= self.max_queue + self.rows

    @property
    def alive(self) -> bool:
        return self._serving is not None and not self._serving.done() and not self._stopping

    def start(self) -> None:
        self._serving = self._engine.submit(self._serve)

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
        """Stop `job`: a waiting one leaves the queue now, a running one leaves its row before the next step."""
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
            for job in self._running:
                job.cancel()
            self._lock.notify_all()
        for job in dropped:
            job.cancel()
            self._finish(job, Update(finish_reason="cancelled"), 0.0)

    def join(self, timeout: float | None = None) -> None:
        if self._serving is not None:
            wait([self._serving], timeout)

    def _admit(self, batch: Any) -> bool:
        """Wait for work; move waiting jobs into the batch's free rows. False: stop serving."""
        with self._lock:
            while not self._waiting and not self._running and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return False
            joining = []
            while self._waiting and batch.room > len(joining):
                joining.append(self._waiting.popleft())
        for job in joining:
            waited = time.perf_counter() - job.submitted
            try:
                row = batch.add(job.prompt_ids, job.params, key=job)
            except Exception as error:  # a request the engine refuses (the handlers check most before submitting)
                self._finish(job, Update(finish_reason="error", error=_first_line(error)), waited)
                continue
            with self._lock:
                self._running[job] = row
                self._waited[job] = waited
        return True

    def _serve(self) -> None:
        batch = self.session.batch(speculative=self.speculative)
        try:
            while self._admit(batch):
                for job, row in list(self._running.items()):
                    if job.cancelled:
                        batch.cancel(row)
                        self._end(job, Update(finish_reason="cancelled", stats=_copy_stats(row)))
                events = batch.step()
                if self.on_step is not None and any(getattr(e, "acceptance_length", None) for _, e in events):
                    self.on_step(len(events))
                for row, event in events:
                    self._deliver(row.key, row, event)
        finally:
            batch.close()
            for job, row in list(self._running.items()):  # stopped: the jobs still decoding end here
                self._end(job, Update(finish_reason="cancelled", stats=_copy_stats(row)))

    def _deliver(self, job: Job, row: Any, event: Any) -> None:
        if isinstance(event, BaseException):  # one failing generation fails its request alone; the worker serves on
            traceback.print_exception(event)
            self._end(job, Update(finish_reason="error", error=_first_line(event), stats=_copy_stats(row)))
        elif event.finish_reason is not None:
            stats = copy.deepcopy(event.stats)
            ids = tuple(event.token_ids)
            self._end(job, Update(event.text, ids, event.finish_reason, stats, cached_tokens=stats.cached_tokens))
        elif not job.cancelled:
            cached = row.generation.stats.cached_tokens
            self._send(job, Update(event.text, tuple(event.token_ids), cached_tokens=cached))

    def _end(self, job: Job, update: Update) -> None:
        with self._lock:
            self._running.pop(job, None)
            waited = self._waited.pop(job, 0.0)
        self._finish(job, update, waited)

    def _send(self, job: Job, update: Update) -> None:
        try:
            job.deliver(update)
        except Exception:  # the reader is gone (its event loop closed): nobody to decode for
            job.cancel()

    def _finish(self, job: Job, update: Update, waited: float) -> None:
        self._send(job, update)
        if self.on_finish is not None:
            self.on_finish(job, update, waited)


def _copy_stats(row: Any) -> Any:
    """The row's numbers so far, or None when it never started (its prefill did not run)."""
    return copy.deepcopy(row.generation.stats) if row.slot is not None else None


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
