"""The `disagg` command (typer): launch, check and query a fleet described by one YAML file.

    disagg launch CONFIG [--serve]      run until Ctrl-C: status lines, or HTTP when CONFIG has `serve`
    disagg check CONFIG                 preflight only; exit 1 with the reason when it fails
    disagg generate CONFIG --prompt TEXT [--prompt ...] | --prompt-file FILE | --prompt-ids 1,2,3
    disagg bench ... / disagg serve ...  registered below by their own packages
    disagg profile / simulate / plan     the simulator's verbs (disagg.cluster.simulate.command)
    disagg --version

Every verb takes ``--set section.key=value`` (repeatable; the value is read as YAML) to override
the file. Exit codes, options and logging shared by the verbs: common.py; `generate`:
generate.py. Runs in the launching process; the entry point is declared in pyproject.toml.
"""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from disagg.cluster.cli.common import (EXIT_RUNTIME, ConfigArg, Interrupted, LogLevelOpt, ReadableCommand,
                                       ReadableGroup, SetOpt, VerboseOpt, interrupts_exit, launch_or_exit, load_config,
                                       setup_logging)
from disagg.cluster.cli.generate import generate_command, stream_to_stdout  # noqa: F401  (demo.py)
from disagg.config import Config
from disagg.errors import DisaggError

# Per verb: its one line in `disagg --help` (short: one line at 60 columns) and the example
# command lines its own --help ends with, printed as written (a " \\" line goes on; 70
# columns at most). tests/cluster/test_cli.py parses each example with its verb.
VERBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "launch": ("Run CONFIG's fleet (and its API) until Ctrl-C", (
        "disagg launch configs/tiny-1p1d.yaml",
        "disagg launch configs/smollm2-1p1d.yaml --serve")),
    "check": ("Preflight CONFIG's fleet, then stop", (
        "disagg check configs/llama3-8b-1p1d.yaml",
        "disagg check configs/tiny-1p1d.yaml --set cache.num_pages=512")),
    "generate": ("Stream answers to prompts on CONFIG's fleet", (
        "disagg generate configs/smollm2-1p1d.yaml --max-tokens 32 \\\n"
        "    --prompt \"Name three prime numbers.\"",
        "disagg generate configs/tiny-1p1d.yaml --prompt-ids 1,2,3,4 --max-tokens 8")),
    "bench": ("Measure serving at the client; compare fleets", (
        "disagg bench configs/tiny-1p1d.yaml --compare configs/tiny-colocated.yaml",
        "disagg bench configs/llama3-8b-1p1d.yaml --dataset-name chat \\\n"
        "    --request-rate 2,4,8 --goodput ttft:2000 tpot:100",
        "disagg bench configs/llama3-8b-1p1d.yaml \\\n"
        "    --set scheduler.max_num_batched_tokens=2048",
        "disagg bench --base-url http://127.0.0.1:8000 --num-prompts 100")),
    "serve": ("Serve the OpenAI API on CONFIG's fleet", (
        "disagg serve configs/smollm2-1p1d.yaml --port 8000",)),
    "profile": ("Time an instance's steps into a profile JSON", (
        "disagg profile configs/llama3-8b-1gpu-colocated.yaml --out profile.json",
        "disagg profile configs/tiny-colocated.yaml --small-grid --out tiny.json",
        "disagg profile configs/llama3-8b-tp2-colocated.yaml --out tp2.json",
        "disagg profile --derive profile.json --tensor-parallel 4 --model dummy:llama3-70b --out 70b-tp4.json")),
    "simulate": ("Simulate CONFIG's fleet from a profile", (
        "disagg simulate configs/llama3-8b-2p2d.yaml --profile profile.json \\\n"
        "    --dataset-name chat --request-rate 8,16",)),
    "plan": ("Rank N-GPU deployments by simulated goodput", (
        "disagg plan --profile profile.json --dataset-name chat \\\n"
        "    --goodput ttft:2000 tpot:100 --gpus 8 --out best.yaml",
        "disagg plan --profile profile.json --dataset-name chat \\\n"
        "    --goodput ttft:2000 tpot:100 --gpus 64 --jobs 8 \\\n"
        "    --only 56P8D,56P8D-adaptive",
        "disagg plan --profile profile.json --profile tp2.json \\\n"
        "    --dataset-name chat --goodput ttft:2000 tpot:100 --gpus 8")),
}


def verb(name: str) -> dict[str, str]:
    """`app.command`'s short_help and epilog (the examples: `ReadableCommand.format_epilog`) of a verb."""
    short_help, examples = VERBS[name]
    return {"short_help": short_help, "epilog": "\n".join(examples)}


app = typer.Typer(name="disagg", no_args_is_help=True, add_completion=False, cls=ReadableGroup,
                  rich_markup_mode=None,  # click's layout (ReadableFormatter): rich cut words at 80 columns
                  help="Disaggregated prefill/decode LLM serving on Ray: one YAML file per deployment.",
                  epilog="Run 'disagg VERB --help' for a verb's options and examples.")


def version_text() -> str:
    """`disagg --version`: the package's version and those of torch, triton and ray."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"
    return f"disagg {of('disagg')} (torch {of('torch')}, triton {of('triton')}, ray {of('ray')})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def main(version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_print_version, is_eager=True, metavar="",
        help="print the versions of disagg, torch, triton and ray, and exit")] = None) -> None:
    """Disaggregated prefill/decode LLM serving on Ray: one YAML file per deployment."""


def _launch(config: Config):
    """`launch_or_exit(config)`, looked up here at call time so tests can replace the launcher."""
    return launch_or_exit(config)


def describe(cluster) -> str:
    """A few lines: mode, device, instances with their PEs and pages, transfer paths."""
    stats = cluster.stats()
    lines = [f"{cluster.config.name}: {stats['mode']} on {stats['device']}"
             + (f", heap {stats['backend']}" if stats["backend"] else "")
             + f", model {cluster.model_name}, max_model_len {stats['max_model_len']}"]
    for inst in stats["instances"]:
        pe = f" PE {inst['pe']}" if inst.get("pe") is not None else ""
        ranks = inst.get("ranks") or []
        if len(ranks) > 1:  # a tensor-parallel instance: every rank's PE and device
            pe = f" TP {len(ranks)}: " + ", ".join(
                f"rank {r['rank']}" + (f" PE {r['pe']}" if r.get("pe") is not None else "") + f" on {r.get('device')}"
                for r in ranks) + ";"
        lines.append(f"  {inst['name']}{pe}: {inst.get('free_pages')}/{inst.get('total_pages')} pages free")
    if stats["paths"]:
        lines.append("  KV paths: " + ", ".join(f"PE {k}: {v}" for k, v in stats["paths"].items()))
    return "\n".join(lines)


def status_line(stats: dict) -> str:
    """One line: per instance running/waiting and free pages; router queue and outcomes."""
    parts = []
    for inst in stats["instances"]:
        if not inst.get("alive", True):
            parts.append(f"{inst['name']} DEAD")
            continue
        parts.append(f"{inst['name']} run {inst.get('running', 0)} wait {inst.get('waiting', 0)} "
                     f"free {inst.get('free_pages')}/{inst.get('total_pages')}")
    router = stats.get("router", {})
    counts = ", ".join(f"{k} {v}" for k, v in sorted(router.get("counts", {}).items()))
    return f"{time.strftime('%H:%M:%S')} | " + " | ".join(parts) + f" | queued {router.get('queued', 0)} | {counts}"


@app.command(cls=ReadableCommand, **verb("launch"))
def launch(config: ConfigArg, set_: SetOpt = None,
           status_every_s: Annotated[float, typer.Option(metavar="SECONDS", help="seconds between status lines")] = 5.0,
           serve: Annotated[bool, typer.Option(
               "--serve", metavar="", help="also serve the OpenAI-compatible HTTP API on serve.host:serve.port; "
                                           "on by default when CONFIG has a serve section")] = False,
           log_level: LogLevelOpt = None, verbose: VerboseOpt = False) -> None:
    """Launch the fleet of CONFIG and keep it up until Ctrl-C or SIGTERM (exit 0): serving HTTP when
    CONFIG has a serve section (or --serve), else printing a status line every few seconds."""
    level = setup_logging(log_level, verbose)
    cfg = load_config(config, set_)
    if serve or "serve" in cfg.model_fields_set:
        _serve(cfg, level)
        return
    with interrupts_exit("disagg launch"):  # Ctrl-C / SIGTERM while the fleet starts (or stops): 130 / 143
        cluster = _launch(cfg)
        typer.echo(describe(cluster))
        try:
            while True:
                time.sleep(status_every_s)
                typer.echo(status_line(cluster.stats()))
        except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM as `Interrupted`: the way to stop a fleet
            typer.echo(f"{'SIGTERM' if isinstance(err, Interrupted) else 'Ctrl-C'}: shutting down")
        finally:
            cluster.shutdown()


def _serve(config: Config, log_level: str) -> None:
    """`disagg launch` of a config with a serve section: `disagg serve`'s path (port bound first)."""
    from disagg.cluster.serve.command import serve_config

    def on_launch(cluster, base_url: str) -> None:
        typer.echo(describe(cluster))
        typer.echo(f"serving the OpenAI API on {base_url}/v1 until Ctrl-C")
    with interrupts_exit("disagg launch"):  # Ctrl-C / SIGTERM before the fleet serves: 130 / 143
        try:
            serve_config(config, log_level=log_level, on_launch=on_launch)
        except DisaggError as err:
            typer.echo(f"{config.path or 'config'}: {type(err).__name__}: {err}", err=True)
            raise typer.Exit(EXIT_RUNTIME) from None
    typer.echo("shutting down")


@app.command(cls=ReadableCommand, **verb("check"))
def check(config: ConfigArg, set_: SetOpt = None, log_level: LogLevelOpt = None, verbose: VerboseOpt = False) -> None:
    """Run the preflight of CONFIG (load weights, compare geometry, size pages, bootstrap the heap), then stop.

    Exit status: 0 when the fleet would serve, 1 with the reason when a check fails, 2 when the
    YAML is invalid.
    """
    setup_logging(log_level, verbose)
    cfg = load_config(config, set_)
    with interrupts_exit("disagg check"):
        cluster = _launch(cfg)
        try:
            typer.echo(describe(cluster))
            typer.echo("preflight OK")
        finally:
            cluster.shutdown()


app.command("generate", cls=ReadableCommand, **verb("generate"))(generate_command)


# ---------------------------------------------------------------------------------------------
# `disagg bench` and `disagg serve`: registered here by their owners, e.g.
#     from disagg.cluster.bench.command import bench_command
#     app.command("bench")(bench_command)
# ---------------------------------------------------------------------------------------------

from disagg.cluster.bench.command import BenchCommand, bench_command  # noqa: E402  (bench owns its command)
app.command("bench", cls=BenchCommand, **verb("bench"))(bench_command)

from disagg.cluster.serve.command import serve_command  # noqa: E402  (serve owns its command)
app.command("serve", cls=ReadableCommand, **verb("serve"))(serve_command)

from disagg.cluster.simulate.command import (greedy_class, plan_command, profile_command,  # noqa: E402
                                             simulate_command)
app.command("profile", cls=ReadableCommand, **verb("profile"))(profile_command)  # the simulator owns its verbs
app.command("simulate", cls=greedy_class(), **verb("simulate"))(simulate_command)
app.command("plan", cls=greedy_class(), **verb("plan"))(plan_command)


if __name__ == "__main__":  # python -m disagg.cluster.cli.app (hosts without the console script)
    app()
