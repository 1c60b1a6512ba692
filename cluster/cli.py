"""The `disagg` command (typer): launch, check and query a fleet described by one YAML file.

    disagg launch CONFIG [--serve]      run until Ctrl-C: status lines, or HTTP when CONFIG has `serve`
    disagg check CONFIG                 preflight only; exit 1 with the reason when it fails
    disagg generate CONFIG --prompt TEXT | --prompt-ids 1,2,3 [--max-tokens ...]
    disagg bench ... / disagg serve ...  registered below by their own packages

Every verb takes ``--set section.key=value`` (repeatable; the value is read as YAML) to override
the file. Runs in the launching process; the entry point is declared in pyproject.toml.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml

from disagg.config import Config
from disagg.errors import ConfigError, DisaggError

app = typer.Typer(name="disagg", no_args_is_help=True, add_completion=False,
                  help="Disaggregated prefill/decode LLM serving on Ray: one YAML file per deployment.")

ConfigArg = Annotated[Path, typer.Argument(help="deployment YAML (see configs/)", show_default=False)]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", help="override a field: section.key=value (value read as YAML), repeatable")]
EXIT_CONFIG, EXIT_PREFLIGHT = 2, 1


def load_config(path: Path, overrides: Optional[list[str]] = None) -> Config:
    """Read ``path`` and apply ``--set`` overrides; exit 2 with the reason when invalid."""
    try:
        config = Config.from_yaml(path)
        if overrides:
            config = config.override(dict(_parse_override(text) for text in overrides))
        return config
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. router.lease_s=10")
    return key.strip(), yaml.safe_load(value)


def _setup_logging(verbose: bool) -> None:
    level = "INFO" if verbose else os.environ.get("DISAGG_LOG", "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("DISAGG_LOG", level)  # the actors inherit it


def _launch(config: Config):
    from disagg.cluster import Cluster
    try:
        return Cluster.launch(config)
    except DisaggError as err:
        typer.echo(f"{config.path or 'config'}: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(EXIT_PREFLIGHT) from None


def describe(cluster) -> str:
    """A few lines: mode, device, instances with their PEs and pages, transfer paths."""
    stats = cluster.stats()
    lines = [f"{cluster.config.name}: {stats['mode']} on {stats['device']}"
             + (f", heap {stats['backend']}" if stats["backend"] else "")
             + f", model {cluster.model_name}, max_model_len {stats['max_model_len']}"]
    for inst in stats["instances"]:
        pe = f" PE {inst['pe']}" if inst.get("pe") is not None else ""
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


@app.command()
def launch(config: ConfigArg, set_: SetOpt = None,
           status_every_s: Annotated[float, typer.Option(help="seconds between status lines")] = 5.0,
           serve: Annotated[bool, typer.Option(help="also serve the OpenAI-compatible HTTP API on "
                                                    "serve.host:serve.port; on by default when CONFIG "
                                                    "has a serve section")] = False,
           verbose: Annotated[bool, typer.Option("--verbose", "-v", help="INFO logs")] = False) -> None:
    """Launch the fleet of CONFIG and keep it up until Ctrl-C: serving HTTP when CONFIG has a serve
    section (or --serve), else printing a status line every few seconds."""
    _setup_logging(verbose)
    cfg = load_config(config, set_)
    if serve or "serve" in cfg.model_fields_set:
        _serve(cfg)
        return
    cluster = _launch(cfg)
    typer.echo(describe(cluster))
    try:
        while True:
            time.sleep(status_every_s)
            typer.echo(status_line(cluster.stats()))
    except KeyboardInterrupt:
        typer.echo("shutting down")
    finally:
        cluster.shutdown()


def _serve(config: Config) -> None:
    """`disagg launch` of a config with a serve section: `disagg serve`'s path (port bound first)."""
    from disagg.cluster.serve.command import serve_config

    def on_launch(cluster, base_url: str) -> None:
        typer.echo(describe(cluster))
        typer.echo(f"serving the OpenAI API on {base_url}/v1 until Ctrl-C")
    try:
        serve_config(config, log_level="warning", on_launch=on_launch)
    except DisaggError as err:
        typer.echo(f"{config.path or 'config'}: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(EXIT_PREFLIGHT) from None
    typer.echo("shutting down")


@app.command()
def check(config: ConfigArg, set_: SetOpt = None,
          verbose: Annotated[bool, typer.Option("--verbose", "-v", help="INFO logs")] = False) -> None:
    """Run the preflight of CONFIG (load weights, compare geometry, size pages, bootstrap the heap), then stop.

    Exit status: 0 when the fleet would serve, 1 with the reason when a check fails, 2 when the
    YAML is invalid.
    """
    _setup_logging(verbose)
    cfg = load_config(config, set_)
    cluster = _launch(cfg)
    try:
        typer.echo(describe(cluster))
        typer.echo("preflight OK")
    finally:
        cluster.shutdown()


@app.command()
def generate(config: ConfigArg,
             prompt: Annotated[Optional[str], typer.Option(help="prompt text (needs a tokenizer)")] = None,
             prompt_ids: Annotated[Optional[str], typer.Option(help="prompt token ids, comma separated")] = None,
             max_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 64,
             temperature: Annotated[float, typer.Option(help="0 is greedy")] = 0.0,
             top_p: Annotated[float, typer.Option(help="nucleus cut, (0, 1]")] = 1.0,
             top_k: Annotated[int, typer.Option(help="keep the k most likely tokens; 0: all")] = 0,
             seed: Annotated[Optional[int], typer.Option(help="sampling seed")] = None,
             ignore_eos: Annotated[bool, typer.Option(help="do not stop at EOS")] = False,
             set_: SetOpt = None,
             verbose: Annotated[bool, typer.Option("--verbose", "-v", help="INFO logs")] = False) -> None:
    """Launch CONFIG, generate for one prompt (streaming the text as it comes), print timings, stop."""
    from disagg.sampling import SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of --prompt TEXT or --prompt-ids 1,2,3", param_hint="--prompt")
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(t) for t in prompt_ids.replace(" ", "").split(",") if t]
        except ValueError:
            raise typer.BadParameter(f"expected integers separated by commas, got {prompt_ids!r}",
                                     param_hint="--prompt-ids") from None
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, ignore_eos=ignore_eos).validate()
    except (ValueError, TypeError) as err:
        raise typer.BadParameter(str(err)) from None
    _setup_logging(verbose)
    cfg = load_config(config, set_)
    cluster = _launch(cfg)
    try:
        if prompt is not None and cluster.tokenizer is None:
            typer.echo(f"{cluster.model_name} has no tokenizer: use --prompt-ids", err=True)
            raise typer.Exit(EXIT_CONFIG)
        final = asyncio.run(stream_to_stdout(cluster, prompt if prompt is not None else ids, params))
    finally:
        cluster.shutdown()
    if final.finish_reason == "error":
        raise typer.Exit(1)


async def stream_to_stdout(cluster, prompt, params, out=None):
    """Print a request's output as it streams (text when there is a tokenizer); return the last delta."""
    out = out or sys.stdout
    tokenizer, token_ids, shown, start = cluster.tokenizer, [], "", time.time()
    first = last = None
    async for delta in cluster.stream(prompt, params):
        token_ids.extend(delta.token_ids)
        if delta.emit_times and first is None:
            first = delta.emit_times[0]
        last = delta
        if tokenizer is not None:
            text = tokenizer.decode(token_ids)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                out.write(text[len(shown):] if text.startswith(shown) else "\n" + text)
                shown = text
        elif delta.token_ids:
            out.write(" ".join(str(t) for t in delta.token_ids) + " ")
        out.flush()
    ttft = f"{(first - start) * 1e3:.1f} ms" if first is not None else "-"
    out.write(f"\n[{len(token_ids)} tokens, finish_reason {last.finish_reason}, TTFT {ttft}"
              + (f", error: {last.error}" if last.error else "") + "]\n")
    return last


# ---------------------------------------------------------------------------------------------
# `disagg bench` and `disagg serve`: registered here by their owners, e.g.
#     from disagg.cluster.bench.command import bench_command
#     app.command("bench")(bench_command)
# ---------------------------------------------------------------------------------------------

from disagg.cluster.bench.command import BenchCommand, bench_command  # noqa: E402  (bench owns its command)
app.command("bench", cls=BenchCommand)(bench_command)

from disagg.cluster.serve.command import serve_command  # noqa: E402  (serve owns its command)
app.command("serve")(serve_command)


if __name__ == "__main__":  # python -m disagg.cluster.cli (hosts without the console script)
    app()
