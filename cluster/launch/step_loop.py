"""The thread that owns one engine: runs its steps and every call into it, in order.

An engine (and its model, heap and CUDA context) is touched by exactly one thread, this one, so
engines need no locks: the actor's methods hand callables to `StepLoop.call` and await the
returned future; between calls the thread runs `engine.step()` whenever the engine has work and
appends the step's outputs to an outbox that the actor drains in batches (`drain`); a caller
that must learn when one request ends (a prefill abort whose pushes are still in flight) gets a
future from `watch_end`.

A tensor-parallel instance runs one engine replica per rank, each its own actor and loop. The
leader's loop (rank 0, the one the router calls; ``group`` set) sends each pass's engine calls
(`EngineCall`, queued with `call_engine`) to the other ranks before it runs them, one broadcast
over the instance's control group; a follower's loop (`follow`) receives the pass, runs the same
calls on its replica, and steps when its replica has work, which is when the leader's has: the
replicas see the same calls in the same order and their KV connectors agree on every poll
(`disagg.transfer.group`). No Ray call per step reaches a follower. Each pass carries the leader's
step count, so a replica that parted from the leader's fails at once (its process exits, which
fails the leader's next collective: the instance dies as a whole). Whether the thread steps is `_has_work`'s answer, asked again after
every call and at least every ``IDLE_WAIT_S``: a subclass may narrow it (hold steps while calls
still run). While tracing is on (`disagg.trace`, checked once per pass of the thread) it writes a
"step" record per step that read a forward and a "call" record per call it ran. Runs inside each
instance actor (`disagg.cluster.launch.actors`); no Ray here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
import traceback
from typing import Any, Callable

from disagg import trace
from disagg.cluster.messages import InstanceLoad, OutputRow, StepSample

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05      # how long the thread sleeps when the engine has no work (woken by calls)
EMPTY_STEP_WAIT_S = 0.001  # pause after a step that produced nothing (e.g. waiting on doorbells)
MID_STEP_POLL_S = 0.0001  # while a forward runs: how often `while_gpu_runs` asks whether it ended

MAX_STEP_SAMPLES = 256  # step samples kept between two drains (the newest win)
# A leader with nothing to send says so this often: the followers' receive never waits long
# enough to time out (the control group's timeout), and a follower learns of a dead leader.
KEEPALIVE_S = 5.0


@dataclasses.dataclass(frozen=True)
class EngineCall:
    """``engine.<method>(*args, **kwargs)``: a call every rank of an instance runs (picklable)."""

    method: str
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)

    def __call__(self, engine: Any) -> Any:
        return getattr(engine, self.method)(*self.args, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class Pass:
    """What the leader sends its followers before a pass: the calls to run, then a step when the
    replica has work. ``num_steps``: the leader's steps before this pass; ``stop``: leave `follow`."""

    calls: tuple[EngineCall, ...] = ()
    num_steps: int = 0
    stop: bool = False


class StepLoop:
    """Runs ``engine.step()`` and queued calls on one thread; see the module docstring.

    Args:
        name: the thread's name (the instance's, e.g. "decode-0").
        on_output: called on the loop thread after outputs were appended (e.g. to wake an
            awaiting `next_outputs`); must not block.
    """

    def __init__(self, name: str, on_output: Callable[[], None] | None = None) -> None:
        self.name = name
        self.engine: Any = None
        self.fatal: str | None = None
        self._on_output = on_output
        self._cond = threading.Condition()
        # (the call, its future, when it was queued: time.time(), may it run mid-step, the
        # EngineCall every rank runs or None)
        self._calls: collections.deque[tuple[functools.partial, concurrent.futures.Future, float, bool,
                                             EngineCall | None]] = collections.deque()
        # A tensor-parallel leader's control group (`disagg.parallel.TPGroup`): each pass's engine
        # calls go to the other ranks first. None: one rank.
        self.group: Any = None
        self._sent_t = 0.0  # when the leader last sent a pass
        self._following = False
        # Leader: names the ranks that are gone, if any (the actor asks them), for the fatal error.
        self.diagnose: Callable[[], str | None] | None = None
        self.num_mid_step_calls = 0  # calls run while a step's forward was on the GPU
        self._outbox: list[OutputRow] = []
        self._samples: collections.deque[StepSample] = collections.deque(maxlen=MAX_STEP_SAMPLES)
        self.load: InstanceLoad | None = None  # after the last step (read from any thread)
        self._end_watches: dict[Any, concurrent.futures.Future] = {}
        self._stopping = False
        self.num_steps = 0
        self.busy_s = 0.0  # seconds spent in steps that ran a forward or had outputs (its utilization)
        self._gpu_end_t: float | None = None  # when the last forward ended, on the GPU's timeline (`_record`)
        self._thread = threading.Thread(target=self._run, name=f"steploop-{name}", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args, **kwargs)`` to run on the loop thread, between steps; return its future.
        It runs on this rank only: a call that changes the engine goes through `call_engine`."""
        return self._queue(functools.partial(fn, *args, **kwargs), False)

    def call_engine(self, call: EngineCall, *, then: Callable[[Any], Any] | None = None,
                    mid_step: bool = False) -> concurrent.futures.Future:
        """Queue ``call`` on the engine, on every rank of the instance; return this rank's result's
        future. ``then(result)`` runs here right after it, in the same pass (this rank only: a
        watch on the call's outcome); ``mid_step``: as `call_mid_step` (one rank only: a
        tensor-parallel leader runs every call between steps)."""
        def run() -> Any:
            result = call(self.engine)
            return result if then is None else then(result)
        run.__qualname__ = call.method  # the trace names the call by its method
        return self._queue(functools.partial(run), mid_step, call)

    def call_mid_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """`call` for a call that may also run while a step's forward is on the GPU (`while_gpu_runs`):
        one that touches no request of a launched step (a decode reservation: new pages, a new
        request). Queue order holds: it runs mid-step only when every call queued before it has run."""
        return self._queue(functools.partial(fn, *args, **kwargs), True)

    def _queue(self, fn: functools.partial, mid_step: bool, record: EngineCall | None = None
               ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                future.set_exception(RuntimeError("the step loop is stopped"))
                return future
            self._calls.append((fn, future, time.time(), mid_step, record))
            self._cond.notify()
        return future

    def follow(self, group: Any) -> None:
        """Loop thread only (the last call a follower's set-up makes): from the next pass on, run
        the passes rank 0 of ``group`` sends (`Pass`) until one says stop; calls queued here
        meanwhile wait until then (the follower's teardown)."""
        self.group = group
        self._following = True

    def while_gpu_runs(self, is_ready: Callable[[], bool]) -> None:
        """The engine's `on_gpu_wait` (loop thread, inside a step, after its launches): until
        ``is_ready()`` says the step's sampled ids are on the host, run the calls at the head of the
        queue that may run mid-step (`call_mid_step`), waking on each new call: a reservation
        answers in about a millisecond instead of after the step, tens of milliseconds on a busy
        instance."""
        tracing = trace.enabled()
        while True:
            with self._cond:
                head = self._calls[0] if self._calls and not self._stopping else None
                if head is None or not head[3]:
                    if is_ready() or self._stopping:
                        return
                    self._cond.wait(MID_STEP_POLL_S)
                    continue
                self._calls.popleft()
            fn, future, queued_t, _, _ = head
            self.num_mid_step_calls += 1
            self._run_call(fn, future, queued_t if tracing else None)

    def drain(self) -> tuple[list[OutputRow], list[StepSample]]:
        """Take every output and step sample produced since the previous drain (any thread)."""
        with self._cond:
            rows, self._outbox = self._outbox, []
            samples = list(self._samples)
            self._samples.clear()
        return rows, samples

    def watch_end(self, request_id: Any) -> concurrent.futures.Future:
        """Loop thread only (inside a `call`): a future resolved with the finish_reason of the
        next finished output of ``request_id`` (it fails if the engine fails or the loop stops)."""
        future = self._end_watches.get(request_id)
        if future is None:
            future = self._end_watches[request_id] = concurrent.futures.Future()
        if self.fatal is not None:
            self._fail_watches("the engine failed earlier")
        return future

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish queued calls, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            if self._following:
                self._follow()
            with self._cond:
                while not self._calls and not self._stopping and not self._has_work() and not self._keepalive_due():
                    self._cond.wait(IDLE_WAIT_S)
                calls, self._calls = self._calls, collections.deque()
                stopping = self._stopping
            tracing = trace.enabled()
            records = tuple(record for *_, record in calls if record is not None)
            if records:
                self._send(Pass(records, self.num_steps))
            for fn, future, queued_t, _, _ in calls:
                self._run_call(fn, future, queued_t if tracing else None)
            if stopping:
                self.release_followers()
                self._fail_watches("the step loop stopped")
                return
            if self._has_work():
                if not records:
                    self._send(Pass((), self.num_steps))
                if not self._step(tracing):
                    with self._cond:
                        if not self._calls:
                            self._cond.wait(EMPTY_STEP_WAIT_S)
            elif self._keepalive_due():
                self._send(Pass((), self.num_steps))

    # ------------------------------------------------------------------ tensor-parallel ranks
    def _keepalive_due(self) -> bool:
        return (self.group is not None and not self._following and self.engine is not None
                and time.monotonic() - self._sent_t > KEEPALIVE_S)

    def _send(self, message: Pass) -> None:
        """Leader: hand this pass to the other ranks (nothing without a group, or once failed)."""
        if self.group is None or self._following or self.engine is None or self.fatal is not None:
            return
        try:
            self.group.broadcast_object(message, src=0)
        except Exception:
            self._fail("broadcast of a pass to the other ranks")
        self._sent_t = time.monotonic()

    def release_followers(self) -> None:
        """Leader, loop thread: tell the other ranks to leave `follow` (before the teardown's
        collective calls, which they then run from their own queues). Once only."""
        if self.group is not None and not self._following and self.engine is not None and self.fatal is None:
            self._send(Pass(stop=True))
            self.group = None

    def _follow(self) -> None:
        """Follower: run the leader's passes on this replica until one says stop. A replica that
        fails or parts from the leader's ends this process: the leader's next collective fails,
        and the instance with it (no rank serves on alone)."""
        group = self.group
        while True:
            try:
                message = group.broadcast_object(None, src=0)
                if message.stop:
                    break
                if message.num_steps != self.num_steps:
                    raise RuntimeError(f"rank {group.rank} parted from the leader: {self.num_steps} steps here, "
                                       f"{message.num_steps} on rank 0")
                for call in message.calls:
                    try:
                        call(self.engine)
                    except Exception:  # the leader's call raised the same (its caller hears it)
                        pass
                if self.engine.has_work():
                    self.engine.step()
                    self.num_steps += 1
            except BaseException:
                logger.error("%s (rank %s) failed; ending the process so that its instance stops:\n%s",
                             self.name, getattr(group, "rank", "?"), traceback.format_exc())
                logging.shutdown()
                os._exit(70)
        self._following = False
        self.group = None

    def _run_call(self, fn: functools.partial, future: concurrent.futures.Future, queued_t: float | None) -> None:
        """Run one queued call; with ``queued_t`` (tracing) write its "call" record."""
        if not future.set_running_or_notify_cancel():
            return
        ran_t = time.time() if queued_t is not None else 0.0
        try:
            future.set_result(fn())
        except BaseException as err:  # handed to the caller, who re-raises it
            future.set_exception(err)
        if queued_t is not None:
            trace.record("call", instance=self.name, name=_call_name(fn.func), t_queued=queued_t, t_ran=ran_t,
                         t_done=time.time())

    def _has_work(self) -> bool:
        """Whether to run a step now: an engine is set, has not failed, and has work (a subclass
        may say False more often; the thread asks again after each call and idle wait). A
        follower steps when its replica has work, so a subclass that narrows this holds a
        tensor-parallel leader's steps but not its followers': they would part from it."""
        if self.engine is None or self.fatal is not None:
            return False
        try:
            return bool(self.engine.has_work())
        except Exception:
            self._fail("has_work")
            return False

    def _step(self, tracing: bool) -> bool:
        """Run one engine step (its "step" record while ``tracing``); return True when it produced
        outputs."""
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            self._fail("step")
            return True
        seconds = time.perf_counter() - start
        self.num_steps += 1
        self._record(seconds, tracing)
        # A forward without outputs (a prompt's chunk before its last) is work too: counted only
        # with outputs, a chunking instance would read far less busy than it is.
        if outputs or getattr(self.engine, "last_step_shape", None) is not None:
            self.busy_s += seconds
        if not outputs:
            return False
        now = time.time()
        rows = [OutputRow(o.request_id, None if o.token_id is None else int(o.token_id), bool(o.finished),
                          o.finish_reason, getattr(o, "error", None), now) for o in outputs]
        with self._cond:
            self._outbox.extend(rows)
        for row in rows:
            if row[2] and row[0] in self._end_watches:
                self._end_watches.pop(row[0]).set_result(row[3])
        if self._on_output is not None:
            self._on_output()
        return True

    def _record(self, seconds: float, tracing: bool) -> None:
        """Keep the step's samples and the load; while ``tracing``, write each step's record. A
        sample is a forward's shape and seconds: each forward's span on the GPU where the engine
        times them (`last_step_forwards`, `disagg.engine.steps.ForwardTimer`: the forwards seen
        ending during this call, maybe none, maybe several), else this call's ``seconds`` for
        the forward whose tokens it read (`last_step_shape`)."""
        load = getattr(self.engine, "load", None)
        if load is not None:
            self.load = load()
        forwards = getattr(self.engine, "last_step_forwards", None)
        if forwards is None:
            shape = getattr(self.engine, "last_step_shape", None)
            if shape is None:
                return
            forwards = [(shape, getattr(self.engine, "last_step_prompts", ()), seconds, None)]
        if not forwards:  # none ended on the GPU during this call
            return
        # Timed on the GPU (``idle``: its idle seconds since the forward before), forwards are
        # placed on the GPU's own timeline: end to end by their spans and idles, after the last
        # one placed, the last ending by now. At the host's reading instead (each ending now),
        # forwards read together would overlap in the trace (a prefill instance over 100% busy,
        # negative gaps between its chunks).
        ends, t = [], 0.0
        for i, (_, _, took, idle) in enumerate(forwards):
            t += (idle or 0.0) if i else 0.0
            t += took
            ends.append(t)
        base = time.time() - ends[-1]
        first_idle = forwards[0][3]
        if first_idle is not None and self._gpu_end_t is not None:
            base = min(self._gpu_end_t + first_idle, base)
        for (shape, prompt_ids, took, idle), end in zip(forwards, ends):
            # decodes waited on the host while the GPU idled before this forward: their tokens'
            # gap (`StepSample.gap_s`; longer than the forward itself: not a steady host cost)
            gap = min(idle, took) if idle is not None and shape.num_decode_seqs else 0.0
            with self._cond:
                self._samples.append(StepSample(shape.num_prefill_tokens, shape.num_decode_seqs,
                                                shape.num_context_tokens, shape.num_prompt_pairs, took, gap))
            self._gpu_end_t = base + end
            if tracing:
                self._trace_step(shape, prompt_ids, took, self._gpu_end_t, idle)

    def _trace_step(self, shape: Any, prompt_ids: tuple, seconds: float, end_t: float,
                    idle: float | None = None) -> None:
        """The "step" record of a forward that took ``seconds`` and ended at ``end_t``
        (`disagg.trace`; ``idle``: the GPU's idle seconds before it, where known)."""
        prompts = [str(r) for r in prompt_ids]
        fields = {"prompts": prompts} if len(prompts) <= trace.MAX_PROMPT_IDS else {}
        if idle is not None:
            fields["gpu_idle_before_s"] = idle
        trace.record("step", instance=self.name, t_start=end_t - seconds, t_end=end_t,
                     num_prefill_tokens=shape.num_prefill_tokens, num_decode_seqs=shape.num_decode_seqs,
                     num_context_tokens=shape.num_context_tokens, num_prompt_pairs=shape.num_prompt_pairs,
                     num_prompts=len(prompts), **fields)

    def _fail(self, what: str) -> None:
        """The engine raised: it is unusable from now on; the router fails its requests."""
        fatal = f"engine.{what}() raised:\n{traceback.format_exc()}"
        if self.group is not None and self.diagnose is not None:
            try:
                gone = self.diagnose()
            except Exception as err:
                gone = f"(the other ranks could not be asked: {err})"
            if gone:
                fatal = f"{fatal.rstrip()}\n{gone}"  # the router quotes the last line
        self.fatal = fatal  # whole, at once: other threads read it (`next_outputs`)
        logger.error("%s", self.fatal)
        self._fail_watches(f"engine.{what}() raised")
        if self._on_output is not None:
            self._on_output()

    def _fail_watches(self, why: str) -> None:
        watches, self._end_watches = self._end_watches, {}
        for request_id, future in watches.items():
            future.set_exception(RuntimeError(f"request {request_id!r} never ended here: {why}"))


def _call_name(fn: Callable[..., Any]) -> str:
    """The name of the function that queued a call: "add" for `InstanceActor.add`'s closure or
    for a bound ``engine.add``."""
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    return qualname.split(".<locals>")[0].rsplit(".", 1)[-1]
