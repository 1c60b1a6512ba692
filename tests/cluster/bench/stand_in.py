"""A Cluster-shaped stand-in that streams scripted tokens, and a typer app holding only `bench`:
the bench's wiring tested without Ray (the real cluster is test_bench_e2e.py's)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import typer

from disagg.cluster.bench.command import BenchCommand, bench_command
from disagg.cluster.outputs import StreamDelta

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TINY_1P1D = str(CONFIGS / "tiny-1p1d.yaml")
TINY_COLOCATED = str(CONFIGS / "tiny-colocated.yaml")


def bench_app() -> typer.Typer:
    """`bench` registered as disagg.cluster.cli.app registers it (a subcommand, BenchCommand's parsing)."""
    app = typer.Typer()
    app.callback()(lambda: None)
    app.command("bench", cls=BenchCommand)(bench_command)
    return app


class StandInCluster:
    """Cluster-shaped: launch/context manager, max_model_len, vocab_size, stats(), stream(),
    reset_prefix_cache() (counted in `num_resets`)."""

    launched: list = []
    num_resets = 0

    def __init__(self, config) -> None:
        self.config = config
        self.max_model_len = 128
        self.vocab_size = 64
        self.busy_s = 0.0
        self.step_s = 0.001 if config.mode == "disaggregated" else 0.002

    @classmethod
    def launch(cls, config):
        cls.launched.append(config)
        return cls(config)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def reset_prefix_cache(self) -> dict:
        type(self).num_resets += 1
        return {}

    def stats(self) -> dict:
        return {"instances": [{"name": f"{self.config.mode}-{i}", "busy_s": self.busy_s} for i in range(2)]}

    async def stream(self, prompt, params, request_id=None):
        assert all(0 <= t < self.vocab_size for t in prompt) and len(prompt) + params.max_tokens <= 128
        for i in range(params.max_tokens):
            await asyncio.sleep(self.step_s)
            self.busy_s += self.step_s
            last = i == params.max_tokens - 1
            yield StreamDelta(request_id, [i], [time.time()], finished=last, finish_reason="length" if last else None)
