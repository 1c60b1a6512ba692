"""Starting a fleet: the Ray connection, the instance actors and their engines.

connect.py: the Ray cluster to join or start (token authentication); preflight.py: the checks
that run before a GPU is touched (pure functions); bootstrap.py: `start_fleet`, placement groups,
weights, the NVSHMEM heap; actors.py: one Ray actor per instance, whose engine (built by
engines.py) runs on a `StepLoop` thread (step_loop.py); instance.py: `Instance`, one instance as
the router and the simulator see it (imports no ray). The design: docs/ARCHITECTURE.md §8.
"""
