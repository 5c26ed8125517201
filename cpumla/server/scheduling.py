"""Scheduling of the one engine: a request takes it (`Slot`) or waits in a FIFO of at most `max_queue`
requests, beyond which the answer is 503. Its prompt is made and generated on the server's single worker
thread (the engine's forward is a blocking native call), so the event loop stays free to accept, queue
and refuse. The engine passes to the next request only once the worker has finished. A client that
disconnects (streaming or not, running or queued) cancels its job (`Watch`): the worker stops before the
next token, or between 512-token chunks of a prefill."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cpumla.chat.generate import Job, PromptError
from cpumla.errors import CpumlaError
from cpumla.server import protocol as P
from cpumla.server.model import ServedModel

log = logging.getLogger("cpumla.server")


class ClientGone(Exception):
    """The client went away before its request got the engine."""


class Slot:
    """The engine: one holder, a bounded FIFO of waiters."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.busy = False
        self.waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return sum(not f.done() for f in self.waiters)

    async def acquire(self, gone: asyncio.Event) -> None:
        if not self.busy:
            self.busy = True
            return
        if self.queued >= self.max_queue:
            raise P.ApiError(503, f"the server is busy: one request is running and {self.queued} are queued "
                                  f"(at most {self.max_queue}); retry later", "server_busy", code="queue_full")
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        watch = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({fut, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._give_up(fut)
            raise
        finally:
            watch.cancel()
        if not fut.done() or gone.is_set():
            self._give_up(fut)
            raise ClientGone()

    def _give_up(self, fut: asyncio.Future) -> None:
        if fut.done() and not fut.cancelled():
            self.release()              # it was handed to us: pass it on
        else:
            fut.cancel()
            with contextlib.suppress(ValueError):
                self.waiters.remove(fut)

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)    # handed over: busy stays True
                return
        self.busy = False


class Watch:
    """Watches a request's connection; a disconnect sets `gone` and cancels the job."""

    def __init__(self, receive):
        self.gone = asyncio.Event()
        self.job: Job | None = None
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()
        if self.job is not None:
            self.job.cancel()

    def close(self) -> None:
        self._task.cancel()


class Runner:
    def __init__(self, served: ServedModel, max_queue: int, seed: int | None):
        self.served = served
        self.slot = Slot(max_queue)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="cpumla-engine")
        self.rng = np.random.default_rng(seed)
        self.job: Job | None = None
        self.closing = False

    async def start(self, watch: Watch, prepare, sampling: P.Sampling, prompt_param: str, **job_kw):
        """Wait for the engine, make the prompt on the worker, start generating; (job, events, done):
        events gets (kind, text) reports and ("done", ""), done is set once the worker has finished.
        Raises ApiError (refused; the engine is free again) or ClientGone."""
        await self.slot.acquire(watch.gone)
        loop = asyncio.get_running_loop()
        try:
            if self.closing:
                raise P.ApiError(503, "the server is shutting down", "server_busy")
            try:
                prompt = await loop.run_in_executor(self.worker, prepare)
                max_tokens = self.served.check(prompt, sampling.max_tokens)
            except PromptError as e:
                raise P.bad(str(e), e.param or prompt_param, e.code) from None
            except CpumlaError as e:
                raise P.bad(str(e)) from None
            if sampling.seed is None:
                sampling.seed = int(self.rng.integers(1 << 63))
            job = Job(prompt, sampling, max_tokens, **job_kw)
            events: asyncio.Queue = asyncio.Queue()

            def emit(kind: str, payload) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

            fut = loop.run_in_executor(self.worker, self.served.run, job, emit)
        except BaseException:
            self.slot.release()
            raise
        self.job = watch.job = job
        if watch.gone.is_set():
            job.cancel()
        done = asyncio.Event()

        def finished(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:      # a bug, not a user error
                e = f.exception()
                job.stats.finish = "error"
                log.error("internal error in the engine's worker", exc_info=e)
                events.put_nowait(("error", f"internal error ({type(e).__name__}; the server log has the details)"))
            events.put_nowait(("done", ""))
            self.job = None
            self.slot.release()
            done.set()

        fut.add_done_callback(finished)
        return job, events, done

    def cancel_all(self) -> None:
        """Shutting down: stop the running job; queued ones are refused when their turn comes."""
        self.closing = True
        job = self.job
        if job is not None:
            job.cancel()


