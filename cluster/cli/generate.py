"""`disagg generate CONFIG`: launch a fleet, stream one or more prompts through it, stop.

A text prompt goes through the model's chat template by default when the tokenizer has one (as
`vllm chat` / `LLM.chat` do), rendered by `disagg.model.tokenizer.Tokenizer.apply_chat_template`
(the template code the HTTP server's /v1/chat/completions uses); `--raw` sends the text as a plain
completion prompt. Every prompt is tokenized and checked against max_model_len and the vocabulary
before the first one runs, so a bad one costs one line and exit 2, not a half-finished run.
Prompts run one after another, each streamed to stdout and closed by a line with its token
count, finish reason, TTFT and decode rate. `generate_command` is registered on the typer app in
`disagg.cluster.cli.app`; it runs in the launching process.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional, Sequence, Union

import typer

from disagg.cluster.cli.common import (EXIT_RUNTIME, EXIT_USAGE, ConfigArg, LogLevelOpt, SetOpt, VerboseOpt,
                                       interrupts_exit, launch_or_exit, load_config, setup_logging)

Prompt = Union[str, list[int]]


def generate_command(
    config: ConfigArg,
    prompt: Annotated[Optional[list[str]], typer.Option(
        metavar="TEXT", help="prompt text (needs a tokenizer); repeat for several prompts", show_default=False)] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(
        metavar="FILE", help="read prompts from FILE, one per line ('-': stdin); blank lines skipped",
        show_default=False)] = None,
    prompt_ids: Annotated[Optional[list[str]], typer.Option(
        metavar="IDS", help="a prompt as token ids, comma separated (1,2,3); repeatable", show_default=False)] = None,
    raw: Annotated[bool, typer.Option(
        "--raw", metavar="", help="send text prompts as they are; default: through the model's chat "
                                  "template when it has one")] = False,
    max_tokens: Annotated[int, typer.Option(metavar="N", help="tokens to generate at most, per prompt")] = 64,
    temperature: Annotated[float, typer.Option(metavar="T", help="0 is greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(metavar="P", help="nucleus cut, (0, 1]")] = 1.0,
    top_k: Annotated[int, typer.Option(metavar="K", help="keep the k most likely tokens; 0: all")] = 0,
    seed: Annotated[Optional[int], typer.Option(metavar="N", help="sampling seed", show_default=False)] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", metavar="", help="do not stop at EOS")] = False,
    set_: SetOpt = None,
    log_level: LogLevelOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Launch CONFIG, stream each prompt's output (text through the chat template of an instruct model,
    unless --raw), print its TTFT and tokens/s, stop. Exit status 0, 1 when a request fails or the
    fleet cannot launch, 2 for bad input (YAML, --set, a prompt too long for max_model_len)."""
    from disagg.sampling import SamplingParams

    prompts = read_prompts(prompt, prompt_file, prompt_ids)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, ignore_eos=ignore_eos).validate()
    except (ValueError, TypeError) as err:
        raise typer.BadParameter(str(err)) from None
    setup_logging(log_level, verbose)
    cfg = load_config(config, set_)
    with interrupts_exit("disagg generate"):
        cluster = launch_or_exit(cfg)
        try:
            encoded = encode_prompts(cluster, prompts, chat=not raw, max_tokens=max_tokens)
            finals = [_stream_one(cluster, label, ids, params, len(prompts) > 1)
                      for label, ids in zip(_labels(prompts), encoded)]
        finally:
            cluster.shutdown()
    if any(final.finish_reason == "error" for final in finals):
        raise typer.Exit(EXIT_RUNTIME)


def read_prompts(texts: Optional[list[str]], prompt_file: Optional[Path],
                 id_lists: Optional[list[str]]) -> list[Prompt]:
    """The prompts of the command line, in order: --prompt, then --prompt-file's lines, then --prompt-ids.

    Raises:
        typer.BadParameter: no prompt at all, an unreadable file, or ids that are not integers.
    """
    prompts: list[Prompt] = list(texts or [])
    if prompt_file is not None:
        try:
            text = sys.stdin.read() if str(prompt_file) == "-" else prompt_file.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise typer.BadParameter(f"cannot read {prompt_file}: {err}", param_hint="--prompt-file") from None
        prompts.extend(line for line in text.splitlines() if line.strip())
    for item in id_lists or []:
        try:
            prompts.append([int(t) for t in item.replace(" ", "").split(",") if t])
        except ValueError:
            raise typer.BadParameter(f"expected integers separated by commas, got {item!r}",
                                     param_hint="--prompt-ids") from None
    if not prompts:
        raise typer.BadParameter("give a prompt: --prompt TEXT (repeatable), --prompt-file FILE or "
                                 "--prompt-ids 1,2,3", param_hint="--prompt")
    return prompts


def encode_prompt(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """Token ids of `text`: as one user turn through the chat template when `chat` and the
    tokenizer has a template (the template writes BOS itself), else encoded as plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))


def encode_prompts(cluster: Any, prompts: Sequence[Prompt], *, chat: bool, max_tokens: int) -> list[list[int]]:
    """Token ids of every prompt, checked to fit the fleet; exit 2 with one line on the first bad one."""
    tokenizer, limit, vocab = cluster.tokenizer, cluster.max_model_len, cluster.vocab_size
    encoded = []
    for number, prompt in enumerate(prompts, 1):
        name = f"prompt {number}" if len(prompts) > 1 else "the prompt"
        if isinstance(prompt, str):
            if tokenizer is None:
                _usage_error(f"{cluster.model_name} has no tokenizer, so text prompts cannot be tokenized; "
                             "give token ids with --prompt-ids 1,2,3")
            try:
                ids = encode_prompt(tokenizer, prompt, chat=chat)
            except Exception as err:  # ChatTemplateError, or the template's own jinja errors
                _usage_error(f"{name}: the chat template of {cluster.model_name} failed: {err}; try --raw")
        else:
            ids = prompt
        if not ids:
            _usage_error(f"{name} is empty; give at least one token")
        if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
            bad = min(ids) if min(ids) < 0 else max(ids)
            _usage_error(f"{name}: token id {bad} is outside the vocabulary of {cluster.model_name} "
                         f"(0..{vocab - 1})")
        if len(ids) >= limit:
            _usage_error(f"{name} is {len(ids)} tokens, and max_model_len is {limit}: no room for an output "
                         "token; shorten it or raise model.max_model_len (--set model.max_model_len=N)")
        if len(ids) + max_tokens > limit:
            _usage_error(f"{name} is {len(ids)} tokens; with --max-tokens {max_tokens} that exceeds "
                         f"max_model_len ({limit}); lower --max-tokens to <= {limit - len(ids)}")
        encoded.append(ids)
    return encoded


def _usage_error(message: str) -> None:
    typer.echo(f"disagg generate: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


def _labels(prompts: Sequence[Prompt]) -> list[str]:
    return [p if isinstance(p, str) else f"{len(p)} token ids {p[:6]}{'...' if len(p) > 6 else ''}"
            for p in prompts]


def _stream_one(cluster: Any, label: str, ids: list[int], params: Any, show_label: bool) -> Any:
    if show_label:
        sys.stdout.write(f">>> {label}\n")
    final = asyncio.run(stream_to_stdout(cluster, ids, params))
    if show_label:
        sys.stdout.write("\n")
    return final


async def stream_to_stdout(cluster: Any, prompt: Prompt, params: Any, out: Any = None) -> Any:
    """Print a request's output as it streams (text when there is a tokenizer, else token ids),
    then one line: tokens, finish reason, TTFT and the decode rate; return the last delta."""
    out = out or sys.stdout
    tokenizer, token_ids, emit_times, shown, start = cluster.tokenizer, [], [], "", time.time()
    last = None
    async for delta in cluster.stream(prompt, params):
        token_ids.extend(delta.token_ids)
        emit_times.extend(delta.emit_times)
        last = delta
        if tokenizer is not None:
            text = tokenizer.decode(token_ids)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                out.write(text[len(shown):] if text.startswith(shown) else "\n" + text)
                shown = text
        elif delta.token_ids:
            out.write(" ".join(str(t) for t in delta.token_ids) + " ")
        out.flush()
    out.write("\n" + summary_line(len(token_ids), last.finish_reason, start, emit_times, last.error) + "\n")
    return last


def summary_line(num_tokens: int, finish_reason: str, start: float, emit_times: Sequence[float],
                 error: str | None = None) -> str:
    """`[N tokens, finish_reason R, TTFT x ms, y tokens/s]`: TTFT from submission to the first
    token; tokens/s the decode rate, tokens after the first over the time since it."""
    ttft = f"{(emit_times[0] - start) * 1e3:.1f} ms" if emit_times else "-"
    span = emit_times[-1] - emit_times[0] if len(emit_times) > 1 else 0.0
    rate = f"{(len(emit_times) - 1) / span:.1f} tokens/s" if span > 0 else "- tokens/s"
    return (f"[{num_tokens} tokens, finish_reason {finish_reason}, TTFT {ttft}, {rate}"
            + (f", error: {error}" if error else "") + "]")
