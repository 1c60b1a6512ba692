"""The simulator of a fleet and the planning verbs: `disagg profile`, `disagg simulate`, `disagg plan`.

instance.py: one instance (the real `Scheduler` over a real `PagedKVCache`, step times from a
profile); fleet.py: the fleet on a virtual clock with the router's placement; run.py: a workload
through it, as `disagg bench`'s result; candidates.py: the deployments searched; screen.py: their
analytic rates; plan.py: the deployment search; command.py: the verbs;
profile.py: an instance's measured step times (`disagg profile`); step_model.py: the step-time model
fitted to them, which the router's adaptive placement uses too.
The design: docs/ARCHITECTURE.md §11.
"""
