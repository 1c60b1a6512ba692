"""`vllm serve`'s option names on `disagg serve`: the ones that mean a YAML field, and the refused ones.

A vLLM user types `--port 8000 --api-key K --max-model-len 4096`; those options exist here under
the same names and override the field of the deployment YAML that they mean (`MAPPED`). Options
of vLLM that have no counterpart (`--tensor-parallel-size`, `--model`, ...) are refused at once,
before anything launches, with what to do instead (`REFUSED`); any other unknown option gets
typer's "No such option". `add_vllm_options` declares both tables' options on the typer command
(they arrive in its ``**vllm_options``); `yaml_overrides` turns the given ones into overrides.
Options the server itself consumes (`--root-path`, `--allowed-origins`, log levels) are plain
parameters of `serve_command` (command.py). Runs in the CLI process.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional

import typer


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


def _refuser(option: RefusedOption) -> Callable[[Any], None]:
    def refuse(value: Any) -> None:
        if value:  # None or False: not given
            raise typer.BadParameter(option.hint)
    return refuse


def _mapped_parameters() -> list[inspect.Parameter]:
    return [inspect.Parameter(opt.param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[opt.type], typer.Option(opt.name, help=opt.help, show_default=False)]) for opt in MAPPED]


def _refused_parameters() -> list[inspect.Parameter]:
    params = []
    for opt in REFUSED:  # eager: refused before "Missing argument 'CONFIG'" when a vLLM user gave --model
        kind = bool if opt.is_flag else Optional[str]
        info = typer.Option(*opt.names, hidden=True, is_eager=True, expose_value=False, callback=_refuser(opt))
        params.append(inspect.Parameter(opt.param, inspect.Parameter.KEYWORD_ONLY,
                                        default=False if opt.is_flag else None, annotation=Annotated[kind, info]))
    return params


def add_vllm_options(command: Callable[..., None]) -> Callable[..., None]:
    """Declare `MAPPED` and `REFUSED` options on a typer command whose last parameter is ``**vllm_options``.

    Typer reads a command's parameters from its signature; this sets ``command.__signature__`` to
    the command's own parameters plus one keyword parameter per option, so the tables stay data.
    The mapped options come right after the command's arguments (first in --help); the refused
    ones are hidden.
    """
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(own) < len(signature.parameters), f"{command.__name__} must take **vllm_options"
    num_arguments = next((i for i, p in enumerate(own) if p.default is not inspect.Parameter.empty), len(own))
    options = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[num_arguments:]]  # typer passes keywords
    params = own[:num_arguments] + _mapped_parameters() + options + _refused_parameters()
    command.__signature__ = signature.replace(parameters=params)
    return command


def yaml_overrides(vllm_options: dict[str, Any]) -> dict[str, Any]:
    """The YAML fields that the given `MAPPED` options set: {"serve.port": 8001, ...}, typed."""
    return {opt.field: vllm_options[opt.param] for opt in MAPPED if vllm_options.get(opt.param) is not None}
