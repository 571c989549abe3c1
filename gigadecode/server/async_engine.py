"""`AsyncEngine`: one `LLMEngine` driven by a background thread, fed and drained from asyncio.

The engine is not thread-safe, so every engine call (`add_request`, `step`, `abort`, reading a finished
request, the connector's handshake) runs on the engine thread: asyncio code posts commands to an inbox
and the thread answers through `loop.call_soon_threadsafe`. The thread loop:

  while running:
      run queued commands (add / abort / call)
      if engine.has_unfinished() or ≥ IDLE_STEP_S since the last step: engine.step()
      else wait ≤ IDLE_WAIT_S for a command

Idle steps (at least every `IDLE_STEP_S`) let a KV connector expire leases while no request runs.
The engine isolates a failing step phase itself (only that phase's requests fail; counted in
`stats["step_failures"]`). Should `engine.step()` still raise, the loop goes on: the requests that were
running (or, if none were, the waiting ones) are aborted, which frees their KV, and finish with an error.

Each request has its own `asyncio.Queue` of `RequestOutput`s. The last one (`finished=True`) carries
`error` (a finished request's `Request.error`) and, as an extra attribute, `kv_transfer_params`
(`Request.kv_transfer_params_out`, the DI producer's answer), or None.

Its Prometheus metrics are `engine_metrics.EngineMetrics` (one registry per engine), refreshed after each
step. An engine that says it can serve no more (`failure`: a parallel engine whose rank failed) ends the
loop: `dead` holds why, `on_dead` hears it (`serve` shuts down and exits with it), `/health` answers 503.
A loop that has shown no progress for `stall_timeout_s` (a step or command that never returns: a kernel or
a peer that hangs) reads as stalled (`stalled_for`): `/health` answers 503 `engine_stalled` until it moves
again, so a router or a readiness probe stops sending it work; `gigadecode_engine_loop_age_seconds` shows it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine import RequestOutput
from ..openmp import release_thread_pool
from ..request import RequestError
from ..sampling import SamplingParams
from .engine_metrics import EngineMetrics

log = logging.getLogger("gigadecode.server")

SHUTTING_DOWN = "the server is shutting down"      # the error of requests still open when the engine stops

# a request a router gave up by name (`give_up`) is refused if it arrives this long after (it lost the race
# with the release), and at most so many such names are remembered
GIVEN_UP_S, GIVEN_UP_MAX = 120.0, 1 << 16

IDLE_WAIT_S = 0.01       # longest wait for new work while idle
IDLE_STEP_S = 0.05       # an idle engine still steps this often (connector lease expiry; for a parallel engine
                         # the heartbeat: its workers wait in the step broadcast, which fails after
                         # --distributed-timeout-s, at least 1 s)
LEASE_DRAIN_POLL_S = 0.02   # how often a prefill server shutting down looks whether its leases have ended
STALL_TIMEOUT_S = 300.0  # `serve --engine-stall-timeout-s`'s default: /health reads 503 `engine_stalled` once the
                         # loop has shown no progress for this long (a step, or a command, that never returns)


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or never started)."""


# --------------------------------------------------------------------------------------------------
# Per-request stream
# --------------------------------------------------------------------------------------------------
@dataclass
class _Track:
    """Engine-thread side of one request: where its outputs go, and its timing."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0


@dataclass
class RequestStream:
    """Asyncio side of one request: iterate it for `RequestOutput`s (the last has finished=True).
    Leaving the iteration early (break, cancellation, client gone) aborts the request."""

    request_id: str
    num_prompt_tokens: int
    _engine: AsyncEngine
    _queue: asyncio.Queue
    finished: bool = False
    _closed: bool = field(default=False, repr=False)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.finished:
                    self.finished = True
                yield item
        finally:
            self.close()

    def release_lease(self) -> None:
        """A prefill whose answer never reached its client: end the request's KV lease (nobody can read it)."""
        self._engine.release_lease(self.request_id)

    def close(self, finish_reason: str = "abort") -> None:
        """Abort the request if it has not finished (idempotent; safe from any code path). `finish_reason`:
        what the metrics count it as ("stop" when a stop string ended it: the client got what it asked for)."""
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._engine.abort(self.request_id, finish_reason)


# --------------------------------------------------------------------------------------------------
# The engine thread
# --------------------------------------------------------------------------------------------------
class AsyncEngine:
    """Runs `engine` on a background thread. `codec` (a `TextCodec` or None) and `model_dir` ride along
    for the HTTP layer. Call `start()` (the app's lifespan does) before submitting requests."""

    def __init__(self, engine: Any, codec: Any = None, model_dir: str | None = None,
                 forget_finished: bool = True, warm_up: bool = False,
                 stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.engine = engine
        self.codec = codec
        self.model_dir = model_dir
        # Drop a finished request from engine.requests once its final output is delivered (a server
        # would otherwise keep every request forever). Set False if the engine needs them later.
        self.forget_finished = forget_finished
        # `engine.warm_up()` on the engine thread before its first step (its OpenMP workers, malloc arena
        # and kernel scratch are that thread's); `ready` is set once it is done (or not asked for)
        self.warm_up = warm_up
        self.ready = threading.Event()
        self.metrics = EngineMetrics()
        self.max_model_len: int = int(engine.max_model_len)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tracks: dict[str, _Track] = {}          # engine thread only
        self._given_up: OrderedDict[str, float] = OrderedDict()    # engine thread only: rid -> refused until
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step_failures_seen = 0
        # why the engine can serve no more (a parallel engine whose rank failed: its `failure`), and who to
        # tell once (`serve` shuts its HTTP server down and exits with the reason)
        self.dead: str | None = None
        self.on_dead: Callable[[str], None] | None = None
        # the loop's last sign of life (each pass: after its commands, after its step, each idle wait), so a
        # step or command that never returns reads as stalled (`stalled_for`) instead of healthy; 0: never
        self.stall_timeout_s = stall_timeout_s
        self._alive_at = time.monotonic()
        self.metrics.loop_age = self.loop_age_s
        self.metrics.refresh(engine)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread. The calling thread (the one that loaded the model, in `serve`) gives up
        its OpenMP workers first, so the engine thread's are the only ones (`openmp.release_thread_pool`)."""
        if self._thread is None:
            release_thread_pool()
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="gigadecode-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the engine thread, waiting up to `timeout` s (None: until it has left its last step)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def drain_leases(self, timeout_s: float) -> int:
        """A prefill engine shutting down: keep stepping until every KV lease has ended (its decode engine read
        the KV, or the lease ran out), at most `timeout_s` and while the engine runs: stopped at once, the
        requests it answered just before would fail on the decode side. -> the leases still held."""
        deadline = time.monotonic() + timeout_s
        left = 0
        while self.is_running and not self._stopping:
            try:                # bounded: an engine wedged in a step never answers, and shutdown must go on
                left = await asyncio.wait_for(
                    self.call(lambda eng: eng.num_leases() if hasattr(eng, "num_leases") else 0),
                    max(deadline - time.monotonic(), 0.0))
            except (EngineDeadError, TimeoutError):
                break
            if not left or time.monotonic() >= deadline:
                break
            await asyncio.sleep(LEASE_DRAIN_POLL_S)
        return left

    def loop_age_s(self) -> float:
        """Seconds since the engine loop last showed progress (0 before it started serving: the warm-up and
        start-up have their own state)."""
        if not self.ready.is_set() or not self.is_running:
            return 0.0
        return max(0.0, time.monotonic() - self._alive_at)

    def stalled_for(self) -> float | None:
        """How long the loop has shown no progress, once that is past `stall_timeout_s` (None: it is not, or
        the watch is off). Any thread; a stall ends by itself when the step returns."""
        age = self.loop_age_s()
        return age if self.stall_timeout_s > 0 and age > self.stall_timeout_s else None

    # -- asyncio API -------------------------------------------------------------------------------
    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     kv_transfer_params: dict | None = None, priority: int = 0) -> RequestStream:
        """Add a request; returns its stream once the engine accepted it. `engine.add_request`'s
        errors (SamplingError, RequestError, ValueError) are raised here."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running" if self.dead is None else
                                  f"the engine stopped: {self.dead}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        accepted: asyncio.Future = loop.create_future()
        arrival = time.monotonic()

        def add() -> None:
            eng = self.engine
            try:
                if self._given_up.get(request_id, 0.0) > time.monotonic():
                    raise RequestError(f"request {request_id!r} was given up by its router before it arrived")
                extra: dict[str, Any] = {}                             # what is not set is not passed
                if kv_transfer_params is not None:
                    extra["kv_transfer_params"] = kv_transfer_params
                if not (type(priority) is int and priority == 0):
                    extra["priority"] = priority
                eng.add_request(prompt_ids, params, request_id=request_id, **extra)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                _resolve(loop, accepted, exc=e)
                return
            self._tracks[request_id] = _Track(loop, q, arrival)
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            _resolve(loop, accepted, result=True)

        self._post(add)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)   # it may have been added just before we were cancelled
            raise
        return RequestStream(request_id, len(prompt_ids), self, q)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       kv_transfer_params: dict | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """submit + iterate: yields the request's `RequestOutput`s; leaving early aborts it."""
        stream = await self.submit(prompt_ids, params, request_id, kv_transfer_params, priority)
        async for out in stream:
            yield out

    def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """Abort a request (thread-safe, non-blocking; a no-op for an unknown or finished one); its final
        output, and the metrics, give it `finish_reason`."""
        def do() -> None:
            eng = self.engine
            try:                               # a stop string's end is a stop (suffix decoding caches it)
                eng.abort(request_id, "stop" if finish_reason == "stop" else "abort")
            except Exception:  # noqa: BLE001
                log.exception("engine.abort(%s) failed", request_id)
            if request_id in self._tracks:
                self._deliver_final(request_id, RequestOutput(request_id, [], True, finish_reason))
            self.metrics.refresh(eng)
        self._post(do)

    def give_up(self, request_ids: Sequence[str]) -> None:
        """A router's client left before the router knew whether these requests (the ids it named) had
        arrived: abort those that did, and refuse any that arrives within GIVEN_UP_S (it would otherwise run,
        and a prefill hold its leased KV until the lease ran out). Posted in order with the adds: an add
        before it is aborted, one after it refused."""
        def do() -> None:
            now = time.monotonic()
            while self._given_up and (next(iter(self._given_up.values())) <= now
                                      or len(self._given_up) >= GIVEN_UP_MAX):
                self._given_up.popitem(last=False)
            for rid in request_ids:
                self._given_up[rid] = now + GIVEN_UP_S
                self._given_up.move_to_end(rid)
        self._post(do)
        for rid in request_ids:
            self.abort(rid)

    def release_lease(self, request_id: str) -> None:
        """A producer: end the KV lease of one of its requests whose answer never reached the client (it left
        after the prefill finished): nobody can read those blocks (thread-safe, non-blocking; a no-op for a
        request without a lease, and on an engine without a KV connector)."""
        self._post(lambda: self.engine.release_lease(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread; returns its result (or raises its exception)."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running" if self.dead is None else
                                  f"the engine stopped: {self.dead}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def do() -> None:
            try:
                res = fn(self.engine)
            except BaseException as e:  # noqa: BLE001
                _resolve(loop, fut, exc=e)
            else:
                _resolve(loop, fut, result=res)
        self._post(do)
        return await fut

    # -- engine thread -----------------------------------------------------------------------------
    def _post(self, cmd: Callable[[], None]) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                cmd()
            except Exception:  # noqa: BLE001 - a command must never kill the loop
                log.exception("engine command failed")

    def _run(self) -> None:
        eng = self.engine
        if self.warm_up and not self.ready.is_set():
            try:
                took = eng.warm_up()
                if took is not None:
                    log.info("engine warmed up in %.2f s", took)
            except Exception:  # noqa: BLE001 - a failed warm-up costs the first request's speed, nothing more
                log.exception("engine warm-up failed; serving without it")
        self._alive_at = time.monotonic()
        self.ready.set()
        last_step = 0.0
        while not self._stopping:
            try:
                self._wake.clear()
                self._drain()
                self._alive_at = now = time.monotonic()
                busy = eng.has_unfinished()
                if busy or now - last_step >= IDLE_STEP_S:
                    work = eng.stats.prefill_tokens + eng.stats.decode_tokens
                    self._step()
                    self._alive_at = last_step = time.monotonic()
                    if busy and eng.stats.prefill_tokens + eng.stats.decode_tokens == work:
                        self._wake.wait(0.001)   # nothing could run (e.g. waiting for KV): don't spin hot
                else:
                    self._wake.wait(min(IDLE_WAIT_S, IDLE_STEP_S - (now - last_step)))
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("engine loop error")
                time.sleep(0.01)
        # shutting down: fail whatever is still open (including requests still in the inbox)
        self._drain()
        for rid in list(self._tracks):
            try:
                eng.abort(rid)
            except Exception:  # noqa: BLE001
                pass
            self._deliver_final(rid, RequestOutput(rid, [], True, "abort", error=SHUTTING_DOWN))

    def _step(self) -> None:
        eng = self.engine
        try:
            outputs = eng.step()
        except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
            self.metrics.step_failures.inc()
            log.exception("engine.step() failed")
            self._fail_after_step_error(f"engine step failed: {type(e).__name__}: {e}")
            self.metrics.refresh(eng)
            self._check_alive()
            return
        self._check_alive()
        failures = eng.stats.step_failures      # phases the engine isolated (their requests failed)
        if failures > self._step_failures_seen:
            self.metrics.step_failures.inc(failures - self._step_failures_seen)
        self._step_failures_seen = failures
        for out in outputs:
            try:
                self._deliver(out)
            except Exception:  # noqa: BLE001
                log.exception("delivering the output of %s failed", out.request_id)
        # requests the engine finished without an output this step (a failed KV transfer, ...)
        for rid in list(self._tracks):
            req = eng.requests.get(rid)
            if req is None or req.finished:
                reason = getattr(req, "finish_reason", None) or "abort"
                self._deliver_final(rid, RequestOutput(rid, [], True, reason,
                                                       error=getattr(req, "error", None)))
        self.metrics.refresh(eng)

    def _check_alive(self) -> None:
        """An engine that says it can serve no more (`failure`, a parallel engine whose rank failed) ends the
        loop: what is still open fails with the shutdown error, and `on_dead` hears why."""
        why = getattr(self.engine, "failure", None)
        if why is None or self.dead is not None:
            return
        self.dead, self._stopping = why, True
        log.error("the engine stopped and serves no more: %s", why)
        if self.on_dead is not None:
            try:
                self.on_dead(why)
            except Exception:  # noqa: BLE001
                log.exception("on_dead failed")

    def _fail_after_step_error(self, msg: str) -> None:
        eng = self.engine
        victims = [r.request_id for r in list(eng.running)] or [r.request_id for r in list(eng.waiting)]
        for rid in victims:
            try:
                eng.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("engine.abort(%s) failed after a step error", rid)
            req = eng.requests.get(rid)
            if req is not None:
                req.error = msg
            if rid in self._tracks:
                self._deliver_final(rid, RequestOutput(rid, [], True, "error", error=msg))
            elif self.forget_finished:
                eng.requests.pop(rid, None)

    def _deliver(self, out: RequestOutput) -> None:
        tr = self._tracks.get(out.request_id)
        if tr is None:
            return
        now = time.monotonic()
        n = len(out.new_token_ids)
        if n:
            if tr.last_token is None:
                self.metrics.ttft.observe(now - tr.arrival)
                for _ in range(n - 1):
                    self.metrics.itl.observe(0.0)
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - tr.last_token) / n)
            tr.last_token = now
            tr.num_tokens += n
            self.metrics.generation_tokens.inc(n)
        if out.finished:
            self._deliver_final(out.request_id, out)
        else:
            _put(tr, out)

    def _deliver_final(self, rid: str, out: RequestOutput) -> None:
        """Attach the finished request's error / kv_transfer_params, send, and forget the request."""
        tr = self._tracks.pop(rid, None)
        req = self.engine.requests.get(rid)
        if req is not None:
            if out.error is None:
                out.error = getattr(req, "error", None)
            if out.finish_reason is None:
                out.finish_reason = req.finish_reason
            out.kv_transfer_params = getattr(req, "kv_transfer_params_out", None)
            if self.forget_finished and req.finished:
                self.engine.requests.pop(rid, None)
        else:
            out.kv_transfer_params = getattr(out, "kv_transfer_params", None)
        out.finished = True
        if out.error is not None and out.finish_reason not in ("abort",):
            out.finish_reason = "error"
        if tr is None:
            return
        now = time.monotonic()
        self.metrics.e2e.observe(now - tr.arrival)
        self.metrics.requests.labels(finish_reason=out.finish_reason or "unknown").inc()
        _put(tr, out)


def _put(tr: _Track, item: Any) -> None:
    try:
        tr.loop.call_soon_threadsafe(tr.queue.put_nowait, item)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
             exc: BaseException | None = None) -> None:
    def set_() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    try:
        loop.call_soon_threadsafe(set_)
    except RuntimeError:
        pass
