"""`StepsAhead`: the reserved and launched-ahead steps of `EngineCore` (its base class).

While the GPU runs a pure-decode step, the engine reserves the next one's slots (`_reserve_next`:
the same running requests, one token each, nobody joining, none at its length limit). After the
sync the reserved step is taken if the scheduler would pick exactly that batch (`_take_reserved`),
else rolled back (`_roll_back`). With async scheduling it is launched before the step in flight's
ids are read (`_launch_ahead`), or, prompts waiting to join (``async_prompts``), the mixed step of
those decodes and the prompts' chunks is (`_launch_behind`). Runs in the engine's process, on
its state (`core.py` owns every attribute read here).
"""

from __future__ import annotations

import numpy as np
import torch

from disagg.engine.request import Request
from disagg.engine.steps import Launched, NextStep, StepShape, same_requests


class StepsAhead:
    """The steps reserved or launched ahead (module docstring); `EngineCore` is the one subclass."""

    def _launch_reserved(self, reserved: NextStep, ids: torch.Tensor, step_offset: int) -> Launched:
        reqs = list(reserved.requests)
        shape = StepShape.of_decodes(reqs)  # a reserved step holds exactly the running requests
        timed = self.timer.begin()
        pending = self._execute(reserved.plan, shape, ids, np.arange(len(reqs)), reqs, step_offset=step_offset)
        self.timer.end(timed, shape, ())
        for req in reqs:
            req.num_computed += 1
        return Launched(reqs, reqs, pending, frozenset(r.seq_id for r in reqs), shape=shape)

    def _launch_ahead(self, current: Launched) -> Launched | None:
        """Launch the next step before ``current``'s ids are read, when the reserved one holds
        exactly ``current``'s requests (all running): that reserved step when none waits to join,
        else (``async_prompts``) those decodes plus the waiting prompts' chunks (`_launch_behind`);
        the decodes' input ids are ``current``'s sampled ids on the device."""
        nxt = self._next
        if nxt is None or not same_requests(nxt.requests, current.sampled):
            return None
        if not same_requests(nxt.requests, self.running) or not self._all_live(nxt.requests):
            return None
        if self._joining():
            return self._launch_behind(current) if self.async_prompts else None
        self._next = None
        self.num_steps_ahead += 1
        return self._launch_reserved(nxt, current.pending.device_tokens, step_offset=1)

    def _launch_behind(self, current: Launched) -> Launched | None:
        """The mixed step launched ahead: the reserved decodes' slots are rolled back, and the
        scheduler takes them again with the waiting local prompts (`Scheduler.schedule_behind`).
        None (nothing launched) when received requests wait to join, a chunk would push, or no
        chunk fits; the next step is then scheduled once ``current``'s tokens are read."""
        if self.ready or (current.pending.push_done is not None):
            return None
        nxt, self._next = self._next, None
        self._roll_back(nxt)
        batch = self.scheduler.schedule_behind(nxt.requests)
        if batch is None or any(r.dest is not None for r in batch.requests[len(nxt.requests):]):
            return None
        self.num_steps_ahead += 1
        self.num_prompt_steps_ahead += 1
        return self._launch(batch, current.pending.device_tokens)

    def _roll_back(self, nxt: NextStep) -> None:
        """Give back the slots a reserved step took (its requests stay in the cache)."""
        for req in nxt.requests:
            if req.in_cache and req.seq_id in self.cache:
                self.cache.popn(req.seq_id, 1)

    def _reserve_next(self, reqs: list[Request]) -> None:
        """Reserve the next step's slots when it will surely be this pure-decode batch again:
        ``reqs`` are exactly the running requests (so decodes only, one token each: a prompt chunk
        belongs to a waiting request), nobody waits to join, none at its length limit."""
        if self._joining() or not same_requests(reqs, self.running):
            return
        max_model_len = self.max_model_len
        for r in reqs:
            num_tokens = len(r.token_ids) + 1  # after the next token
            if num_tokens - r.num_prompt_tokens >= r.params.max_tokens or num_tokens >= max_model_len:
                return
        # Pages the uncommitted ones take (a token after a full page takes one); committed ones
        # draw on their promise.
        size = self.cache.page_size
        lengths = self.cache.seq_lengths([r.seq_id for r in reqs if not r.committed_pages])
        if sum(1 for n in lengths if n % size == 0) > self.scheduler.free_pages():
            return  # the scheduler will preempt at the next step
        plan = self._begin_forward([r.seq_id for r in reqs], [1] * len(reqs))
        if plan is not None:
            self.cache.end_forward()
        self._next = NextStep(list(reqs), plan)

    def _take_reserved(self) -> NextStep | None:
        """The reserved step if the scheduler would pick exactly its batch now, else None (its
        slots rolled back)."""
        nxt, self._next = self._next, None
        if nxt is None:
            return None
        if (nxt.device_ids is not None and not self._joining() and same_requests(nxt.requests, self.running)
                and self._all_live(nxt.requests)):
            return nxt
        self._roll_back(nxt)
        return None
