"""vLLM's option names on `disagg serve` and `disagg bench`: one table per command, one mechanism.

`disagg serve`: a vLLM user types `--port 8000 --api-key K --max-model-len 4096`; those options exist here under
the same names and override the field of the deployment YAML that they mean (`MAPPED`). Options
of vLLM that have no counterpart (`--tensor-parallel-size`, `--model`, ...) are refused at once,
before anything launches, with what to do instead (`REFUSED`); any other unknown option gets
typer's "No such option". `add_vllm_options` declares both tables' options on the typer command
(they arrive in its ``**vllm_options``); `yaml_overrides` turns the given ones into overrides.
Options the server itself consumes (`--root-path`, `--allowed-origins`, log levels) are plain
parameters of `serve_command` (command.py).

`disagg bench`: `vllm bench serve`'s options that mean something here are plain parameters of
`bench_command` under the same names; `BENCH_IGNORED` are accepted and change nothing (the bench
always does what they ask), `BENCH_REFUSED` exit 2 with what to use instead. vLLM takes
`--goodput ttft:500 tpot:50` (one flag, several values: argparse's nargs="+"); click takes one
value per flag, so `greedy_command` builds a command class that folds such trailing values into
repeated flags before parsing. Runs in the CLI process.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperCommand

from disagg.cluster.cli.common import ReadableCommand


@dataclass(frozen=True)
class MappedOption:
    """A vLLM option that sets one field of the deployment YAML."""

    name: str
    field: str
    type: type
    help: str

    @property
    def param(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class RefusedOption:
    """A vLLM option disagg does not take: `names` (long first) and what to do instead."""

    names: tuple[str, ...]
    hint: str
    is_flag: bool = False

    @property
    def param(self) -> str:
        return "refused_" + self.names[0].removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class IgnoredOption:
    """A vLLM flag accepted for vLLM users' sake that changes nothing here; `why` says so in --help."""

    name: str
    why: str

    @property
    def param(self) -> str:
        return "ignored_" + self.name.removeprefix("--").replace("-", "_")


MAPPED = (
    MappedOption("--host", "serve.host", str, "bind address; overrides serve.host (default 127.0.0.1)"),
    MappedOption("--port", "serve.port", int, "TCP port; overrides serve.port (default 8000; 0: a free one)"),
    MappedOption("--api-key", "serve.api_key", str, "bearer key every /v1 request must send; overrides "
                                                    "serve.api_key (else DISAGG_API_KEY)"),
    MappedOption("--served-model-name", "serve.served_model_name", str, "model id of /v1/models and of "
                                                                        "requests; overrides serve.served_model_name"),
    MappedOption("--max-model-len", "model.max_model_len", int, "longest prompt + output, tokens; "
                                                                "overrides model.max_model_len"),
    MappedOption("--dtype", "model.dtype", str, "auto, float32, bfloat16 or float16; overrides model.dtype"),
    MappedOption("--gpu-memory-utilization", "cache.gpu_memory_fraction", float,
                 "fraction of each GPU an instance may use; overrides cache.gpu_memory_fraction"),
    MappedOption("--block-size", "cache.page_size", int, "tokens per KV page; overrides cache.page_size"),
    MappedOption("--kv-cache-dtype", "cache.kv_dtype", str, "auto or fp8_e4m3; overrides cache.kv_dtype"),
    MappedOption("--max-num-seqs", "scheduler.max_num_seqs", int, "sequences per forward; overrides "
                                                                  "scheduler.max_num_seqs"),
    MappedOption("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", int,
                 "new tokens per forward; overrides scheduler.max_num_batched_tokens"),
)

_ONE_GPU = "each instance runs on one GPU (or a share of one: instances.gpus_per_instance)"
REFUSED = (
    RefusedOption(("--model",), "give the deployment YAML as CONFIG and set model.source in it "
                                "(an HF directory, 'smollm2' or 'dummy:<preset>')"),
    RefusedOption(("--tensor-parallel-size", "-tp"), f"not supported: disagg has no tensor parallelism; {_ONE_GPU}"),
    RefusedOption(("--pipeline-parallel-size", "-pp"), f"not supported: disagg has no pipeline parallelism; "
                                                       f"{_ONE_GPU}"),
    RefusedOption(("--data-parallel-size", "-dp"), "set instances.prefill and instances.decode (or "
                                                   "instances.colocated) in the YAML: every instance is a replica"),
    RefusedOption(("--tokenizer",), "the tokenizer is read from model.source (its tokenizer.json)"),
    RefusedOption(("--chat-template",), "the chat template is read from model.source (tokenizer_config.json "
                                        "or chat_template.jinja)"),
    RefusedOption(("--quantization", "-q"), "not supported: weights load in model.dtype; for fp8 KV pages "
                                            "use --kv-cache-dtype fp8_e4m3"),
    RefusedOption(("--trust-remote-code",), "not needed: disagg runs its own Llama-family model code", True),
    RefusedOption(("--enable-prefix-caching",), "set cache.prefix_caching in the YAML", True),
    RefusedOption(("--distributed-executor-backend",), "disagg always runs on Ray; join a running Ray "
                                                       "cluster with cluster.address"),
    RefusedOption(("--ssl-keyfile", "--ssl-certfile"), "not supported: terminate TLS in a reverse proxy "
                                                       "in front of disagg serve"),
)


_ONE_WORKLOAD = "disagg bench draws synthetic token-id workloads: --dataset-name random, prefill-heavy, " \
                "decode-heavy, long-prompt or chat"
_GREEDY = "the bench decodes greedily with EOS ignored, so every run produces the same lengths"
BENCH_REFUSED = (
    RefusedOption(("--dataset-path",), f"no dataset files: {_ONE_WORKLOAD}"),
    RefusedOption(("--sharegpt-output-len",), f"no ShareGPT: {_ONE_WORKLOAD}; output length: --output-len"),
    RefusedOption(("--random-prefix-len",), "random prompts share no prefix; for one: --dataset-name shared-prefix"),
    RefusedOption(("--tokenizer-mode",), "prompts are token ids: no tokenizer runs at the client"),
    RefusedOption(("--use-beam-search",), "not supported: disagg serves greedy and sampled decoding only", True),
    RefusedOption(("--logprobs",), "not supported: disagg serve returns no logprobs"),
    RefusedOption(("--temperature", "--top-p", "--top-k", "--min-p", "--frequency-penalty",
                   "--presence-penalty", "--repetition-penalty"), f"not taken: {_GREEDY}"),
    RefusedOption(("--probe-request-rate",), "not supported: time a second workload with its own run"),
    RefusedOption(("--profile",), "not supported: profile the actors with DISAGG_LOG=DEBUG or nsys", True),
    RefusedOption(("--append-result",), "every run writes its own file, dated "
                                        "(<label>-<rate>qps-<date>.json); --result-filename names one", True),
    RefusedOption(("--self-timed",), f"no traces: {_ONE_WORKLOAD}", True),
    RefusedOption(("--request-id-prefix",), "request ids are chosen by the bench (bench<N>-<request>-<n>)"),
    RefusedOption(("--lora-modules", "--lora-assignment"), "not supported: disagg serves no LoRA adapters"),
    RefusedOption(("--ramp-up-strategy", "--ramp-up-start-rps", "--ramp-up-end-rps"),
                  "sweep fixed rates instead: --request-rate 1,2,4,8 (add --early-stop to stop at the collapse)"),
    RefusedOption(("--chat-template-kwargs", "--extra-body"), "not taken: requests carry token ids and the "
                                                              "bench's own sampling settings only"),
    RefusedOption(("--plot-timeline", "--plot-dataset-stats"), "not supported: a comparison (--compare) "
                                                               "writes its PNG plots to --result-dir", True),
    RefusedOption(("--timeline-itl-thresholds",), "not supported: there is no timeline plot"),
)
BENCH_IGNORED = (
    IgnoredOption("--ignore-eos", "always on: the bench ignores EOS so output lengths are exact"),
    IgnoredOption("--save-detailed", "always on: results keep every request's TTFT, ITLs and error"),
    IgnoredOption("--trust-remote-code", "not needed: prompts are token ids, no tokenizer code runs"),
    IgnoredOption("--skip-tokenizer-init", "always so: prompts are token ids, no tokenizer loads"),
)


def _refuser(option: RefusedOption) -> Callable[[Any], None]:
    def refuse(value: Any) -> None:
        if value:  # None or False: not given
            raise typer.BadParameter(option.hint)
    return refuse


def _mapped_parameters(mapped: tuple[MappedOption, ...]) -> list[inspect.Parameter]:
    return [inspect.Parameter(opt.param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[opt.type], typer.Option(opt.name, help=opt.help, show_default=False)]) for opt in mapped]


def _refused_parameters(refused: tuple[RefusedOption, ...]) -> list[inspect.Parameter]:
    params = []
    for opt in refused:  # eager: refused before "Missing argument 'CONFIG'" when a vLLM user gave --model
        kind = bool if opt.is_flag else Optional[str]
        info = typer.Option(*opt.names, hidden=True, is_eager=True, expose_value=False, callback=_refuser(opt))
        params.append(inspect.Parameter(opt.param, inspect.Parameter.KEYWORD_ONLY,
                                        default=False if opt.is_flag else None, annotation=Annotated[kind, info]))
    return params


def _ignored_parameters(ignored: tuple[IgnoredOption, ...]) -> list[inspect.Parameter]:
    return [inspect.Parameter(opt.param, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option(opt.name, help=f"accepted for vLLM's sake: {opt.why}", expose_value=False)])
        for opt in ignored]


def add_vllm_options(command: Callable[..., None] | None = None, *, mapped: tuple[MappedOption, ...] = MAPPED,
                     refused: tuple[RefusedOption, ...] = REFUSED, ignored: tuple[IgnoredOption, ...] = ()):
    """Declare `mapped`, `refused` and `ignored` options on a typer command whose last parameter is
    ``**vllm_options`` (as ``@add_vllm_options``: `disagg serve`'s tables; as
    ``@add_vllm_options(mapped=..., refused=..., ignored=...)``: another command's).

    Typer reads a command's parameters from its signature; this sets ``command.__signature__`` to
    the command's own parameters plus one keyword parameter per option, so the tables stay data.
    The mapped options come right after the command's arguments (first in --help), the ignored
    ones last; the refused ones are hidden. Only mapped options reach ``**vllm_options``.
    """
    def declare(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        assert len(own) < len(signature.parameters), f"{command.__name__} must take **vllm_options"
        num_arguments = next((i for i, p in enumerate(own) if p.default is not inspect.Parameter.empty), len(own))
        options = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[num_arguments:]]  # typer: keywords
        params = (own[:num_arguments] + _mapped_parameters(mapped) + options + _ignored_parameters(ignored)
                  + _refused_parameters(refused))
        command.__signature__ = signature.replace(parameters=params)
        return command
    return declare if command is None else declare(command)


def greedy_command(values: dict[str, str]) -> type[TyperCommand]:
    """A typer command class that reads ``--flag A B`` as ``--flag A --flag B``, as argparse's nargs="+" does.

    Args:
        values: flag -> regular expression a following token must match in full to be folded in
            (so `disagg bench --goodput ttft:500 tpot:50 CONFIG` still sees CONFIG as CONFIG).
    """
    patterns = {flag: re.compile(pattern) for flag, pattern in values.items()}

    class GreedyCommand(ReadableCommand):
        def parse_args(self, ctx, args: list[str]) -> list[str]:
            return super().parse_args(ctx, fold_greedy(args, patterns))

    return GreedyCommand


def fold_greedy(args: list[str], patterns: dict[str, re.Pattern]) -> list[str]:
    """``["--goodput", "ttft:500", "tpot:50"]`` -> ``["--goodput", "ttft:500", "--goodput", "tpot:50"]``."""
    folded, flag, expect_value = [], None, False
    for index, arg in enumerate(args):
        if arg == "--":  # the rest are arguments
            return folded + args[index:]
        if expect_value:
            expect_value = False
        elif flag is not None and patterns[flag].fullmatch(arg):
            folded.append(flag)
        else:
            name = arg.split("=", 1)[0]
            flag = name if name in patterns else None
            expect_value = flag is not None and "=" not in arg
        folded.append(arg)
    return folded


def yaml_overrides(vllm_options: dict[str, Any]) -> dict[str, Any]:
    """The YAML fields that the given `MAPPED` options set: {"serve.port": 8001, ...}, typed."""
    return {opt.field: vllm_options[opt.param] for opt in MAPPED if vllm_options.get(opt.param) is not None}
