"""What every `disagg` verb shares: exit codes, the CONFIG/--set/--log-level options, config loading,
logging set-up (disagg's, the actors' and Ray's), fleet launch and the Ctrl-C/SIGTERM exit.

Exit status of every verb (docs/serving.md's "Logs and exit status" has the same table):

    0    done; `launch` / `serve` stopped by Ctrl-C or SIGTERM (their normal end)
    1    runtime failure: the preflight or fleet launch failed, a port cannot be bound, a request failed
    2    bad input: invalid YAML or --set, a bad option or prompt (too long for max_model_len, ...)
    130  a verb that had not finished (`check`, `generate`, a fleet still launching) got Ctrl-C
    143  the same for SIGTERM

Used by `disagg.cluster.cli.app` and the verbs' own modules (generate.py); runs in the
launching process.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import signal
import textwrap
import threading
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import click
import typer
import yaml
from typer.core import TyperCommand, TyperGroup

from disagg.config import Config
from disagg.errors import ConfigError, DisaggError

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LogLevel(str, Enum):
    """A ``--log-level`` of every verb (and `serve`'s ``--uvicorn-log-level``): Python's level names,
    lower case, and uvicorn's ``trace``, which is DEBUG for every other logger (`python_level`)."""

    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


def python_level(level: str) -> str:
    """The `logging` level name of a `LogLevel` value (or of $DISAGG_LOG's text): ``trace`` is DEBUG."""
    return "DEBUG" if level.lower() == LogLevel.trace.value else level.upper()


ConfigArg = Annotated[Path, typer.Argument(metavar="CONFIG", help="deployment YAML (see configs/)",
                                           show_default=False)]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="KEY=VALUE", show_default=False,
    help="override a field: section.key=value (value read as YAML), repeatable")]
LogLevelOpt = Annotated[Optional[LogLevel], typer.Option(
    metavar="LEVEL", show_default=False,
    help="critical|error|warning|info|debug|trace (trace: debug, and uvicorn's own in serve): disagg's logs "
         "here and in the actors, and Ray's; default $DISAGG_LOG, else warning")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", metavar="", help="INFO logs (--log-level info)")]

# The workload and result flags that `disagg bench` and `disagg simulate` share (vLLM's names);
# each verb's default where the flag is left out is the config's `bench` section.
NumPromptsOpt = Annotated[Optional[int], typer.Option(min=1, help="requests per run (default bench.num_prompts)")]
RunSecondsOpt = Annotated[Optional[float], typer.Option(min=0.001, help="per rate, send about rate x this many "
                          "requests (at least --min-prompts, at most --num-prompts: the first ones sampled)")]
MinPromptsOpt = Annotated[int, typer.Option(min=1, help="fewest requests of a run under --run-seconds")]
InputLenOpt = Annotated[Optional[int], typer.Option(min=1, help="prompt tokens (= --random-input-len)")]
OutputLenOpt = Annotated[Optional[int], typer.Option(min=1, help="output tokens (= --random-output-len)")]
RandomInputLenOpt = Annotated[Optional[int], typer.Option(min=1, help="prompt tokens")]
RandomOutputLenOpt = Annotated[Optional[int], typer.Option(min=1, help="output tokens")]
RangeRatioOpt = Annotated[Optional[float], typer.Option(help="lengths uniform in len*(1 +- r)")]
SeedOpt = Annotated[Optional[int], typer.Option(help="seed of prompts and arrivals (default bench.seed)")]
RequestRateOpt = Annotated[Optional[str], typer.Option(
    help="req/s; a sweep: 1,2,4,inf (default bench.request_rates)")]
BurstinessOpt = Annotated[Optional[float], typer.Option(help="gamma shape of arrivals; 1 = Poisson")]
MaxConcurrencyOpt = Annotated[Optional[int], typer.Option(min=1, help="requests in flight at most")]
MetricPercentilesOpt = Annotated[str, typer.Option(help="percentiles reported")]
ResultFilenameOpt = Annotated[Optional[str], typer.Option(help="file name of a single run's JSON")]


METAVARS = {"str": "TEXT", "int": "N", "int range": "N", "float": "X", "float range": "X", "Path": "PATH",
            "path": "PATH", "file": "PATH", "dir": "DIR", "bool": ""}


_FLAG_AND_VALUE = re.compile(r"(?<!\S)(--[a-z][a-z0-9-]*) (?=\S)")


def wrap_whole_words(text: str, width: int, indent: str = "") -> list[str]:
    """``text``'s paragraphs (split at blank lines) filled to ``width`` columns, each line starting
    with ``indent``, without ever cutting a word: a word longer than the line (a path, a flag, a
    dotted override) runs past it whole, a hyphen is not a break, and a ``--flag`` stays on the line
    of the word after it (``--set scheduler.max_num_batched_tokens=2048`` reads as one piece). A
    paragraph whose first line is ``\\b`` is kept as written, line for line (click's convention)."""
    wrapper = textwrap.TextWrapper(max(1, width - len(indent)), break_long_words=False,
                                   break_on_hyphens=False)
    out: list[str] = []
    for paragraph in [p for p in text.split("\n\n") if p.strip()]:
        lines = paragraph.splitlines()
        out += [""] if out else []
        if lines[0].strip() == "\b":
            out += [indent + line for line in lines[1:]]
            continue
        glued = _FLAG_AND_VALUE.sub("\\1\0", " ".join(lines))  # a NUL: no break there; a space again below
        out += [indent + line.replace("\0", " ") for line in wrapper.wrap(glued)]
    return out


class ReadableFormatter(click.HelpFormatter):
    """click's help layout (`disagg` runs typer without rich: ``rich_markup_mode=None``) with every
    piece of text filled by `wrap_whole_words`: no word of a help text, no example, is cut at any
    terminal width (rich cut them with an ellipsis in an 80-column options table)."""

    def write_text(self, text: str) -> None:
        indent = " " * self.current_indent
        self.write("\n".join(wrap_whole_words(text, self.width, indent)) + "\n")

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((len(first) for first, _ in rows), default=0), col_max) + col_spacing
        pad = " " * (self.current_indent + first_col)
        for first, second in rows:
            self.write(" " * self.current_indent + first)
            if not second:
                self.write("\n")
                continue
            self.write(" " * (first_col - len(first)) if len(first) <= first_col - col_spacing else "\n" + pad)
            lines = [line.lstrip() for line in wrap_whole_words(second, max(self.width - first_col - 2, 10))]
            self.write(("\n" + pad).join(lines) + "\n")


class ReadableContext(typer.Context):
    formatter_class = ReadableFormatter


class ReadableGroup(TyperGroup):
    """The `disagg` group: its help through `ReadableFormatter` (one line per verb: each verb's
    ``short_help``)."""

    context_class = ReadableContext


class ReadableCommand(TyperCommand):
    """A typer command whose help names values as users read them (PATH, TEXT, N) where typer 0.29
    prints Python types (``<list[str]>``, ``<bool>``), and shows on/off flags bare; its help is laid
    out by `ReadableFormatter`, and its epilog is the verb's example command lines, printed as
    written under "Examples:". Register every verb with ``cls=ReadableCommand`` (or a subclass)."""

    context_class = ReadableContext

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        if self.epilog:
            with formatter.section("Examples"):
                formatter.write_text("\b\n" + inspect.cleandoc(self.epilog))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.metavar is None:
                param.metavar = readable_metavar(param)
            if param.param_type_name == "argument":  # its name says it; no "<path>" column beside it
                param.display_type_rich = lambda ctx: None
                if param.required:  # click's usage form, CONFIG (typer 0.29 writes {CONFIG})
                    param.get_usage_pieces = lambda ctx, name=param.metavar: [name]

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


def readable_metavar(param: Any) -> str:
    """The value's kind for help (`METAVARS`; a list shows its element's), the argument's name in
    capitals, choices as ``a|b``; ``""`` for an on/off flag."""
    if getattr(param, "is_bool_flag", False) or getattr(param, "is_flag", False):
        return ""
    if param.param_type_name == "argument":
        return (param.name or "arg").upper()
    display_type = getattr(param, "display_type", None)  # typer >= 0.2x's own parameter types
    if display_type is None:  # typer on click: click's names (text, integer, path, ...)
        kind = getattr(param.type, "name", "text")
        return {"text": "TEXT", "integer": "N", "float": "X", "path": "PATH", "boolean": ""}.get(kind, kind.upper())
    label = display_type(click.Context(click.Command("help"))).strip("<>")
    if label.startswith("list[") and label.endswith("]"):
        label = label[len("list["):-1]
    return METAVARS.get(label, label)


def load_config(path: Path, overrides: Optional[list[str]] = None) -> Config:
    """Read ``path`` and apply ``--set`` overrides; exit 2 with the reason when invalid."""
    try:
        config = Config.from_yaml(path)
        if overrides:
            config = config.override(dict(parse_override(text) for text in overrides))
        return config
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(EXIT_USAGE) from None


def parse_override(text: str) -> tuple[str, Any]:
    """``section.key=value`` -> (key, the value read as YAML).

    Raises:
        ConfigError: no ``=``, no key, or a value that is not YAML.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. router.lease_s=10")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({problem}); quote it for a "
                          f"string, e.g. --set '{key.strip()}=\"...\"'") from None


class _HideTokenAuthNotice(logging.Filter):
    """Drops Ray's "Token authentication is enabled" notice, printed by every embedded `ray.init`:
    it reports the secure default, not a problem. Its "disabled" warning still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled")


def setup_logging(log_level: Optional[LogLevel], verbose: bool = False) -> str:
    """Set the level of disagg's logs here and in the actors, and of Ray's driver logs.

    Below INFO (the default, warning), Ray's start-up lines ("Started a local Ray instance", the
    token-auth notice) are hidden; --log-level info or -v shows them.

    Args:
        log_level: the level; None: info with `verbose`, else $DISAGG_LOG, else warning.
        verbose: -v, the same as --log-level info.

    Returns:
        the level as uvicorn names it (lower case).
    """
    import ray  # noqa: F401  (its import installs the "ray" logger's handlers set below)

    name = (log_level.value if log_level else "info" if verbose else os.environ.get("DISAGG_LOG") or "warning").lower()
    level = python_level(name)
    logging.basicConfig(format=LOG_FORMAT)
    logging.getLogger("disagg").setLevel(level)
    os.environ["DISAGG_LOG"] = level                  # the actors read it (passed on by the bootstrap)
    os.environ["RAY_LOGGER_LEVEL"] = level.lower()    # the Ray processes that ray.init starts
    quiet = logging.getLevelName(level) > logging.INFO
    # ray.init sets the "ray" logger's own level back to INFO; the level of its handlers is ours.
    for handler in logging.getLogger("ray").handlers:
        handler.setLevel(level)
        if quiet and not any(isinstance(f, _HideTokenAuthNotice) for f in handler.filters):
            handler.addFilter(_HideTokenAuthNotice())
    return name


def launch_or_exit(config: Config) -> Any:
    """`Cluster.launch(config)`; exit 1 with one line when the preflight or launch fails."""
    from disagg.cluster import Cluster

    try:
        cluster = Cluster.launch(config)
    except DisaggError as err:
        typer.echo(f"{config.path or 'config'}: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    catch_sigterm()  # ray.init replaced our handler with its own sys.exit(15)
    return cluster


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would raise KeyboardInterrupt, so both unwind the same way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def catch_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupted)


@contextmanager
def interrupts_exit(command: str) -> Iterator[None]:
    """Turn Ctrl-C and SIGTERM inside the block into one line on stderr and exit 130 / 143.

    The block's own `finally` clauses (the fleet's shutdown) run first. During `ray.init`, Ray's
    SIGTERM handler calls sys.exit(15): that exit is taken for SIGTERM too.
    """
    previous = signal.getsignal(signal.SIGTERM)
    catch_sigterm()
    try:
        yield
    except KeyboardInterrupt as err:
        _exit_interrupted(command, getattr(err, "signum", signal.SIGINT))
    except SystemExit as err:
        if err.code != signal.SIGTERM:
            raise
        _exit_interrupted(command, signal.SIGTERM)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _exit_interrupted(command: str, signum: int) -> None:
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    typer.echo(f"{command}: interrupted by {name}; stopped", err=True)
    raise typer.Exit(128 + signum)
