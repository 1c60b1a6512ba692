"""The typer commands `disagg profile`, `disagg simulate` and `disagg plan` (registered by
`disagg.cluster.cli`).

    disagg profile CONFIG --out profile.json [--small-grid]
    disagg simulate CONFIG --profile profile.json [bench's workload, rate and result flags]
    disagg plan --profile profile.json --dataset-name W --goodput ttft:MS tpot:MS --gpus N [--out best.yaml]

Exit status: 0 done; 1 the engine could not be built or run; 2 a bad flag, config or profile.
Runs in the CLI process (no Ray).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from disagg.cluster.cli_common import (EXIT_RUNTIME, EXIT_USAGE, ConfigArg, LogLevelOpt, SetOpt, VerboseOpt,
                                       load_config, setup_logging)

Opt = typer.Option


def profile_command(
    config: ConfigArg,
    out: Annotated[Path, Opt("--out", help="where the profile JSON goes")] = Path("profile.json"),
    small_grid: Annotated[bool, Opt("--small-grid", help="a few shapes only (CPU tests, a quick look)")] = False,
    set_: SetOpt = None, log_level: LogLevelOpt = None, verbose: VerboseOpt = False,
) -> None:
    """Time CONFIG's instance (its real engine, in this process) over a grid of prefill, decode and
    mixed steps; fit the router's step-time model; write the samples, the fit and its error per
    region to --out."""
    from disagg.cluster.profile import SMALL_GRID, Grid, run_profile, save_profile, summary_lines
    from disagg.errors import DisaggError

    setup_logging(log_level, verbose)
    cfg = load_config(config, set_)
    try:
        profile = run_profile(cfg, SMALL_GRID if small_grid else Grid())
    except DisaggError as err:
        typer.echo(f"disagg profile: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    path = save_profile(profile, out)
    for line in summary_lines(profile):
        typer.echo(line)
    typer.echo(f"profile: {path}")


def read_profile(path: Path) -> dict:
    """The profile at ``path``; exit 2 naming the problem when it is not one."""
    from disagg.cluster.profile import load_profile

    try:
        return load_profile(path)
    except ValueError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(EXIT_USAGE) from None
