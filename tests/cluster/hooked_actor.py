"""The instance actor of the cluster tests: `InstanceActor` plus the hooks a test drives it with.

`HookedInstanceActor` adds `drop_next` (a prefill instance accepts requests and never runs
them), `stall`/`unstall` (the step loop holds: no step, no call, as a slow instance),
`pause_steps`/`resume_steps` (calls run, steps do not, as an engine whose forward is still
going) and `hold_push`/`wait_push_held`/`release_push` (a prefill forward holds right after its
first layer's K/V went to the decode instance: a push started and not finished, as a sender
that died or went silent mid-push); `PausableStepLoop` is its step loop. `with_own_environment` makes a subclass whose
actors set variables in their own process environment first. The launcher starts the class that
`disagg.cluster.launch.bootstrap.ACTOR_CLASS` names (`cluster_helpers.launch_config` swaps it in). This
folder is no installed package, so this module is pickled by value: the classes travel to the
actors' processes with their code.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Any

from ray import cloudpickle

from disagg.cluster.launch.actors import InstanceActor
from disagg.cluster.launch.step_loop import StepLoop

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PausableStepLoop(StepLoop):
    """A `StepLoop` whose steps can be held while calls still run (`pause_steps`)."""

    def __init__(self, name: str, on_output=None) -> None:
        # Set before the thread starts (it asks `_has_work` at once). Steps stop once num_steps
        # reaches it; None: step freely.
        self._step_limit: int | None = None
        super().__init__(name, on_output=on_output)

    def pause_steps(self, after_num_steps: int = 0) -> None:
        """Loop thread only: run ``after_num_steps`` more steps, then none until `resume_steps`."""
        self._step_limit = self.num_steps + after_num_steps

    def resume_steps(self) -> None:
        """Loop thread only: end `pause_steps`."""
        self._step_limit = None

    def _has_work(self) -> bool:
        if self._step_limit is not None and self.num_steps >= self._step_limit:
            return False
        return super()._has_work()


class HookedInstanceActor(InstanceActor):
    """`InstanceActor` with the test hooks of the module docstring (same arguments)."""

    step_loop_class = PausableStepLoop

    def __init__(self, role: str, name: str, config: dict, rank: int = 0) -> None:
        super().__init__(role, name, config, rank)
        self._num_to_drop = 0
        self._dropped: set = set()
        self._unstall = threading.Event()
        self._push_held, self._push_release = threading.Event(), threading.Event()

    async def add(self, request_id: Any, prompt_token_ids: list[int], params: Any, dest: Any = None) -> None:
        """`InstanceActor.add`, except that a prefill instance told to `drop_next` keeps the
        request: accepted, never run, its KV never pushed."""
        if self.role == "prefill" and self._num_to_drop:
            self._num_to_drop -= 1
            self._dropped.add(request_id)
            return
        await super().add(request_id, prompt_token_ids, params, dest)

    async def abort(self, request_id: Any) -> Any:
        """`InstanceActor.abort`; a dropped request is forgotten (None: the engine never had it)."""
        if request_id in self._dropped:
            self._dropped.discard(request_id)
            return None
        return await super().abort(request_id)

    async def drop_next(self, num_requests: int) -> None:
        """Prefill: accept the next ``num_requests`` requests and never run them."""
        self._num_to_drop = num_requests

    async def num_dropped(self) -> int:
        """The requests held by `drop_next` now (accepted, never run, not yet aborted)."""
        return len(self._dropped)

    async def stall(self, seconds: float) -> None:
        """Hold the step loop (no step, no call) for up to ``seconds`` or until `unstall`, as a
        slow instance would; returns once the loop is held."""
        held, self._unstall = threading.Event(), threading.Event()
        unstall = self._unstall

        def hold() -> None:
            held.set()
            unstall.wait(seconds)
        self.loop.call(hold)
        await asyncio.get_running_loop().run_in_executor(None, held.wait, 30.0)

    async def unstall(self) -> None:
        """End a `stall` early."""
        self._unstall.set()

    async def hold_push(self, seconds: float) -> None:
        """Prefill: the next forward that pushes holds its step thread (no step, no call) right
        after its first layer's K/V went out (`KVSender.save_layer` of layer 0, or a whole-forward
        `save_written`), for up to ``seconds`` or until `release_push`; then it goes on."""
        held, release = threading.Event(), threading.Event()
        self._push_held, self._push_release = held, release

        def arm() -> None:
            sender = self.loop.engine.sender
            save_layer, save_written = sender.save_layer, sender.save_written

            def hold() -> None:
                if not held.is_set():
                    held.set()
                    release.wait(seconds)

            def held_save_layer(layer, k, v, **scales):
                save_layer(layer, k, v, **scales)
                if layer == 0:
                    hold()

            def held_save_written(plan):
                done = save_written(plan)
                hold()
                return done
            sender.save_layer, sender.save_written = held_save_layer, held_save_written
        await self._run(arm)

    async def wait_push_held(self, timeout_s: float) -> bool:
        """Whether a forward armed by `hold_push` holds (waits up to ``timeout_s`` for it)."""
        return await asyncio.get_running_loop().run_in_executor(None, self._push_held.wait, timeout_s)

    async def release_push(self) -> None:
        """End a `hold_push` hold early (the forward goes on)."""
        self._push_release.set()

    async def pause_steps(self, after_num_steps: int = 0) -> None:
        """Let the engine run ``after_num_steps`` more steps, then hold its steps (calls still
        run: the engine takes requests and aborts but computes nothing). One-rank instances only:
        a tensor-parallel leader's followers step by their own replicas (`stall` holds a TP
        instance)."""
        await self._run(self.loop.pause_steps, after_num_steps)

    async def resume_steps(self) -> None:
        """End `pause_steps`."""
        await self._run(self.loop.resume_steps)


def with_own_environment(actor_class: type[InstanceActor], **variables: str) -> type[InstanceActor]:
    """A subclass of ``actor_class`` whose actors set ``variables`` in their own process
    environment before their set-up (as an actor on another host has its own environment).
    Variables read when a module is imported are out of its reach: the class's module imports
    `disagg` before its ``__init__`` runs."""
    def __init__(self, role: str, name: str, config: dict, rank: int = 0) -> None:
        os.environ.update(variables)
        actor_class.__init__(self, role, name, config, rank)
    return type(f"{actor_class.__name__}WithOwnEnvironment", (actor_class,),
                {"__init__": __init__, "__module__": __name__})
