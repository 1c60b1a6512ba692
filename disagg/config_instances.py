"""The `instances` section of a deployment: how many instances of each role, their ranks, where.

An instance is one engine the router sees; at ``tensor_parallel`` k it runs as k rank actors,
each holding 1/k of the heads and the MLP. GPUs are counted per rank: ``gpus_per_instance`` is
one rank's share of a GPU (1/k puts k ranks on one GPU), so a fleet occupies
``num_ranks * gpus_per_instance`` GPUs. The rules here need only the file; the ones that need
the model (heads and MLP width divide by the ranks) run in the launch's preflight before Ray
starts (`disagg.cluster.launch.preflight.check_tensor_parallel`). Pure Python: part of
`disagg.config`, which re-exports `InstancesSection`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from disagg.config_yaml import Section, suggest

TP_ROLES = ("prefill", "decode", "colocated")  # the keys of a per-role instances.tensor_parallel


class InstancesSection(Section):
    """How many engine instances run, how many ranks each has, and where (a GPU or a share of one
    per rank, or the CPU)."""

    prefill: int = Field(0, ge=0, description="prefill instances (disaggregated mode), count")
    decode: int = Field(0, ge=0, description="decode instances (disaggregated mode), count")
    colocated: int = Field(0, ge=0, description="colocated instances (prefill and decode in one "
                                                "engine: the baseline), count")
    tensor_parallel: int | dict[str, int] = Field(
        1, description="ranks per instance (tensor parallelism: each rank one actor holding its share of "
                       "the heads and the MLP), an int >= 1 for every role, or per role ({prefill: 2, "
                       "decode: 2}, {colocated: 2}; a role left out: 1); prefill and decode may differ "
                       "(each prefill rank pushes its KV heads into the decode ranks that hold them); the "
                       "model's query heads and MLP width must divide by each, and its KV heads divide by "
                       "each or each by them (checked before launch)")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto: one GPU (or gpus_per_instance of one) per rank when the cluster has "
                            "enough, else the CPU")
    cpus_per_instance: float = Field(1.0, gt=0.0, description="Ray CPU resources per rank actor, cores")
    gpus_per_instance: float = Field(
        1.0, gt=0.0,
        description="GPUs per rank (an instance of tensor_parallel k holds k of these), a fraction 1/k puts "
                    "k ranks on one GPU (Ray fractional GPUs; NVSHMEM runs them as PEs of one GPU in its "
                    "limited multi-process mode); each sizes its pages from its share of the GPU's memory; "
                    "above 1 is refused (more GPUs per instance: tensor_parallel). Timings of ranks sharing "
                    "a GPU are time-sliced: never a comparison of deployments")

    @field_validator("tensor_parallel", mode="before")
    @classmethod
    def _ranks_known(cls, value: object) -> object:
        if isinstance(value, dict):
            for role, ranks in value.items():
                if role not in TP_ROLES:
                    raise ValueError(f"unknown role {role!r} in {value!r}{suggest(str(role), TP_ROLES)}")
                if not _is_ranks(ranks):
                    raise ValueError(f"{role}: expected ranks per instance, an int >= 1, got {ranks!r}")
        elif not _is_ranks(value):  # the value itself is shown after the message
            raise ValueError(f"expected ranks per instance, an int >= 1, or a mapping of {', '.join(TP_ROLES)} "
                             "to them")
        return value

    @model_validator(mode="after")
    def _whole_share(self) -> InstancesSection:
        if self.gpus_per_instance > 1.0:
            raise ValueError(f"gpus_per_instance is per rank, at most one GPU; got {self.gpus_per_instance}: "
                             "spread an instance over several GPUs with instances.tensor_parallel (use 1.0, "
                             "or 1/k to share a GPU)")
        share = 1.0 / self.gpus_per_instance
        if abs(share - round(share)) > 1e-6:
            raise ValueError(f"gpus_per_instance must be 1/k for a whole k (1.0, 0.5, 0.25, ...), got "
                             f"{self.gpus_per_instance}")
        return self

    @model_validator(mode="after")
    def _one_mode(self) -> InstancesSection:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError(f"colocated ({self.colocated}) excludes prefill ({self.prefill}) and decode "
                             f"({self.decode}): give either colocated >= 1, or prefill >= 1 and decode >= 1")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError(f"a disaggregated fleet needs prefill >= 1 and decode >= 1, got prefill="
                             f"{self.prefill}, decode={self.decode} (or set colocated >= 1)")
        return self

    @model_validator(mode="after")
    def _ranks_per_role(self) -> InstancesSection:
        if isinstance(self.tensor_parallel, dict):
            idle = [role for role in TP_ROLES if role in self.tensor_parallel and not getattr(self, role)]
            if idle:
                raise ValueError(f"tensor_parallel gives {', '.join(idle)}, which this fleet has no instances "
                                 f"of (prefill {self.prefill}, decode {self.decode}, colocated {self.colocated}); "
                                 f"got {self.tensor_parallel!r}")
        return self

    @property
    def mode(self) -> Literal["disaggregated", "colocated"]:
        return "colocated" if self.colocated else "disaggregated"

    @property
    def num_instances(self) -> int:
        return self.colocated or self.prefill + self.decode

    def tensor_parallel_of(self, role: str) -> int:
        """Ranks of each instance of ``role`` (prefill, decode or colocated).

        Raises:
            ValueError: ``role`` is not one of those.
        """
        if role not in TP_ROLES:
            raise ValueError(f"role: expected one of {', '.join(TP_ROLES)}, got {role!r}")
        if isinstance(self.tensor_parallel, dict):
            return self.tensor_parallel.get(role, 1)
        return self.tensor_parallel

    @property
    def num_ranks(self) -> int:
        """Rank actors of the whole fleet: each instance's tensor_parallel, summed."""
        return sum(getattr(self, role) * self.tensor_parallel_of(role) for role in TP_ROLES)

    @property
    def ranks_per_gpu(self) -> int:
        """k of ``gpus_per_instance = 1/k``: how many ranks share one GPU."""
        return round(1.0 / self.gpus_per_instance)

    @property
    def num_gpus(self) -> int:
        """GPUs the fleet occupies when it runs on GPUs: ``num_ranks * gpus_per_instance``, rounded up."""
        return -(-self.num_ranks // self.ranks_per_gpu)


def _is_ranks(value: object) -> bool:
    """``value`` is an int >= 1 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
