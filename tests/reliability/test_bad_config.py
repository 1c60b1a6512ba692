"""Replay of broken deployment files through `disagg check`, in process (typer's CliRunner).

Every case is a real YAML file that must be refused before anything starts: exit status 2, one
`ConfigError` message naming the file and the field path at fault (the key and line for a key
given twice; file:line:col for YAML that does not parse), and no Python traceback. The classes:
wrong types (strings for ints, floats, bools; numbers for bools; floats for ints), keys given
twice (top level, nested, flow style), empty or blank paths, unknown keys and sections, bad enum
values (kernels switches included), negative or zero counts, a share of a GPU that is not 1/k or
above 1, tensor parallelism that is not an int >= 1 or a mapping of known roles, the cross-field
rules, and YAML that does not parse (an unclosed list, a tab indent). The launcher is replaced by
a recorder: a case that got past validation counts as "launched". A second replay: valid files
whose model does not shard over their tensor_parallel (a role's, or one side of a prefill/decode
pair), refused by the launch's preflight before Ray starts (exit 1; Ray's `connect` replaced by a
recorder that counts the cases that reached it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from disagg.cluster.cli import app as cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BASE = CONFIGS / "tiny-1p1d.yaml"


def _set(dotted: str, value) -> dict:
    return {"set": (dotted, value)}


def _text(text: str) -> dict:
    return {"text": text}


# name -> (what to break, text the message must hold: the field path, or the key and line)
CASES = {
    # strings, floats or numbers where the schema wants another type
    "int as string": (_set("instances.prefill", "1"), "instances.prefill: Input should be a valid integer (got '1')"),
    "page size as string": (_set("cache.page_size", "16"), "cache.page_size: Input should be a valid integer"),
    "pages as float": (_set("cache.num_pages", 256.0), "cache.num_pages: Input should be a valid integer"),
    "decode as float": (_set("instances.decode", 1.5), "instances.decode: Input should be a valid integer"),
    "seconds as string": (_set("router.lease_s", "30"), "router.lease_s: Input should be a valid number"),
    "timeout as word": (_set("router.request_timeout_s", "never"), "router.request_timeout_s:"),
    "bool as int": (_set("transfer.force_segment_puts", 1), "transfer.force_segment_puts: Input should be a valid boolean"),
    "push mode unknown": (_set("transfer.push_after", "sometimes"),
                          "transfer.push_after: Input should be 'graphs', 'never' or 'always' (got 'sometimes')"),
    "bool as string": (_set("cluster.warmup", "yes"), "cluster.warmup: Input should be a valid boolean (got 'yes')"),
    "bool as 'true'": (_set("scheduler.async_scheduling", "true"), "scheduler.async_scheduling: Input should be a valid boolean"),
    "port as string": (_set("serve.port", "8000"), "serve.port: Input should be a valid integer"),
    "rate as string": (_set("bench.request_rates", ["1"]), "bench.request_rates.0: Input should be a valid number"),
    "section as list": (_set("router", [1, 2]), "router: Input should be a valid dictionary"),
    "source as number": (_set("model.source", 7), "model.source: Input should be a valid string"),
    # a key given twice: YAML's safe_load would keep the last one silently
    "top-level twice": (_text("model:\n  source: 'dummy:tiny'\n"), "model given twice (first at line"),
    "nested twice": (_text("router:\n  lease_s: 30\n  lease_s: 5\n"), "router given twice"),
    "key twice": ({"replace": ("  page_size: 16", "  page_size: 16\n  page_size: 32")},
                  "cache.page_size given twice (first at line"),
    "flow twice": ({"replace": ("  device: cpu", "  device: cpu\n  device: cuda")}, "instances.device given twice"),
    # empty or blank paths
    "empty source": (_set("model.source", ""), "model.source: expected an HF directory"),
    "blank source": (_set("model.source", "  "), "model.source: expected an HF directory"),
    "empty compare_with": (_set("bench.compare_with", ""), "bench.compare_with: expected the path"),
    # unknown keys and sections
    "unknown key": (_set("cache.page_sise", 16), "cache.page_sise: unknown key; did you mean 'page_size'?"),
    "unknown section": (_set("routr", {"lease_s": 3}), "routr: unknown key; did you mean 'router'?"),
    "unknown kernel switch": (_set("kernels.linar", "triton"), "kernels.linar: unknown key; did you mean 'linear'?"),
    # values outside an enum
    "bad dtype": (_set("model.dtype", "fp16"), "model.dtype: Input should be"),
    "bad backend": (_set("transfer.backend", "nccl"), "transfer.backend: Input should be"),
    "bad device": (_set("instances.device", "gpu"), "instances.device: Input should be"),
    "bad policy": (_set("router.policy", "random"), "router.policy: Input should be"),
    "bad kv dtype": (_set("cache.kv_dtype", "int8"), "cache.kv_dtype: Input should be"),
    "bad linear": (_set("kernels.linear", "cuda"), "kernels.linear: Input should be 'auto', 'cublas' or 'triton'"),
    "bad pdl": (_set("kernels.layer_pdl", 1), "kernels.layer_pdl: expected 'auto', true or false"),
    "bad rope append": (_set("kernels.rope_append", "0"), "kernels.rope_append: Input should be a valid boolean"),
    "bad adaptive preference": (_set("router.adaptive_prefer", "local"), "router.adaptive_prefer: Input should be 'fastest', 'remote' or 'balanced'"),
    "overlap as string": (_set("scheduler.overlap_reservations", "on"), "scheduler.overlap_reservations: Input should be a valid boolean"),
    # negative or zero counts and sizes
    "negative prefill": (_set("instances.prefill", -1), "instances.prefill: Input should be greater than or equal to 0"),
    "negative colocated": (_set("instances.colocated", -2), "instances.colocated: Input should be greater"),
    "negative pages": (_set("cache.num_pages", -5), "cache.num_pages: Input should be greater than 0"),
    "zero seqs": (_set("scheduler.max_num_seqs", 0), "scheduler.max_num_seqs: Input should be greater than 0"),
    "negative lease": (_set("router.lease_s", -1), "router.lease_s: Input should be greater than 0"),
    "zero gpus": (_set("instances.gpus_per_instance", 0), "instances.gpus_per_instance: Input should be greater"),
    # a GPU share that is not 1/k, or more than one GPU
    "gpu share 0.4": (_set("instances.gpus_per_instance", 0.4), "instances: gpus_per_instance must be 1/k"),
    "gpu share 2": (_set("instances.gpus_per_instance", 2),
                    "instances: gpus_per_instance is per rank, at most one GPU; got 2.0: spread an instance over "
                    "several GPUs with instances.tensor_parallel"),
    # tensor parallelism: ranks per instance, an int >= 1 or a mapping of known roles to them
    "tp zero": (_set("instances.tensor_parallel", 0), "instances.tensor_parallel: expected ranks per instance, an "
                                                      "int >= 1, or a mapping of prefill, decode, colocated to them (got 0)"),
    "tp as string": (_set("instances.tensor_parallel", "2"), "instances.tensor_parallel: expected ranks per instance"),
    "tp as bool": (_set("instances.tensor_parallel", True), "instances.tensor_parallel: expected ranks per instance"),
    "tp role zero": (_set("instances.tensor_parallel", {"prefill": 0, "decode": 0}),
                     "instances.tensor_parallel: prefill: expected ranks per instance, an int >= 1, got 0"),
    "tp unknown role": (_set("instances.tensor_parallel", {"prefil": 2, "decode": 2}),
                        "instances.tensor_parallel: unknown role 'prefil' in {'prefil': 2, 'decode': 2}; did you mean "
                        "'prefill'?"),
    "tp role not in the fleet": (_set("instances.tensor_parallel", {"colocated": 2}),
                                 "instances: tensor_parallel gives colocated, which this fleet has no instances of"),
    # cross-field rules
    "page size not a power of two": (_set("cache.page_size", 12), "cache: page_size must be a power of two"),
    "no decode": (_set("instances.decode", 0), "instances: a disaggregated fleet needs prefill >= 1 and decode >= 1"),
    "fp8 on cpu": (_set("cache.kv_dtype", "fp8_e4m3"), "cache.kv_dtype fp8_e4m3 needs GPUs"),
    "missing model": ({"drop": "model"}, "model: Field required"),
    # YAML that does not parse: the file, line and column, never "<unicode string>"
    "unclosed flow list": (_text("extra: [1\n"), "not valid YAML: expected ',' or ']'"),
    "tab indent": (_text("router:\n\tlease_s: 5\n"), "YAML indents with spaces, never tabs"),
}


# Valid files whose model does not shard over their tensor_parallel: name -> (what to change, text the
# message must hold). MODEL_DIR stands for an HF directory of 12 query heads and 3 KV heads.
MODEL_DIR = "<model dir>"
UNSHARDED = {
    "tp 3, query heads": (_set("instances.tensor_parallel", 3),
                          "instances.tensor_parallel: prefill instances at tensor_parallel 3 cannot shard dummy:tiny: "
                          "its 4 query heads (num_qo_heads) do not divide by 3"),
    "tp 8, more ranks than heads": (_set("instances.tensor_parallel", 8),
                                    "its 4 query heads (num_qo_heads) do not divide by 8; degrees that shard it: 1, 2, 4"),
    "tp 2, smollm2 heads": ({"set": [("model.source", "dummy:smollm2-135m"), ("instances.tensor_parallel", 2)]},
                            "its 9 query heads (num_qo_heads) do not divide by 2; its 3 KV heads (num_kv_heads) do "
                            "not divide by 2, nor is 2 a multiple of 3"),
    "tp 9, MLP width": ({"set": [("model.source", "dummy:smollm2-135m"), ("instances.tensor_parallel", 9)]},
                        "cannot shard dummy:smollm2-135m: its MLP width (intermediate_size 1536) does not divide by 9; "
                        "degrees that shard it: 1, 3"),
    "tp 4, KV heads": ({"set": [("model.source", MODEL_DIR), ("instances.tensor_parallel", 4)]},
                       "cannot shard model: its 3 KV heads (num_kv_heads) do not divide by 4, nor is 4 a multiple of 3"),
    "tp 3, colocated": (_set("instances", {"colocated": 1, "tensor_parallel": 3, "device": "cpu"}),
                        "instances.tensor_parallel: colocated instances at tensor_parallel 3 cannot shard dummy:tiny"),
    "tp 3 for prefill and decode, mapping": (_set("instances.tensor_parallel", {"prefill": 3, "decode": 3}),
                                             "prefill instances at tensor_parallel 3 cannot shard dummy:tiny"),
    "tp pair, decode side": (_set("instances.tensor_parallel", {"prefill": 2, "decode": 3}),
                             "instances.tensor_parallel: prefill 2 pushing into decode 3: decode instances at "
                             "tensor_parallel 3 cannot shard dummy:tiny: its 4 query heads (num_qo_heads) do not "
                             "divide by 3"),
    "tp pair, smollm2 prefill side": ({"set": [("model.source", "dummy:smollm2-135m"),
                                               ("instances.tensor_parallel", {"prefill": 2, "decode": 3})]},
                                      "instances.tensor_parallel: prefill 2 pushing into decode 3: prefill instances "
                                      "at tensor_parallel 2 cannot shard dummy:smollm2-135m"),
}


def _write(tmp_path: Path, name: str, change: dict) -> Path:
    text = BASE.read_text()
    if "set" in change or "drop" in change:
        raw = yaml.safe_load(text)
        if "drop" in change:
            del raw[change["drop"]]
        else:
            for dotted, value in change["set"] if isinstance(change["set"], list) else [change["set"]]:
                *sections, key = dotted.split(".")
                node = raw
                for section in sections:
                    node = node.setdefault(section, {})
                node[key] = value
        text = yaml.safe_dump(raw, sort_keys=False)
    elif "replace" in change:
        old, new = change["replace"]
        assert old in text, f"{name}: {old!r} is not in {BASE.name}"
        text = text.replace(old, new, 1)
    else:
        text += change["text"]
    path = tmp_path / f"{name.replace(' ', '_').replace(chr(39), '')}.yaml"
    path.write_text(text)
    return path


def test_every_broken_config_exits_2_naming_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    launched = []

    def recorder(config):
        launched.append(config.path)
        raise cli.typer.Exit(99)

    monkeypatch.setattr(cli, "_launch", recorder)  # nothing may get this far
    runner = CliRunner()
    counts = {"tried": 0, "exit_2": 0, "named": 0, "tracebacks": 0, "launched": 0}
    wrong = []
    for name, (change, expected) in CASES.items():
        path = _write(tmp_path, name, change)
        result = runner.invoke(cli.app, ["check", str(path)])
        counts["tried"] += 1
        counts["exit_2"] += result.exit_code == 2
        named = expected in result.output and str(path) in result.output
        counts["named"] += named
        counts["tracebacks"] += "Traceback" in result.output or (
            result.exception is not None and not isinstance(result.exception, SystemExit))
        if result.exit_code != 2 or not named:
            wrong.append(f"{name}: exit {result.exit_code}, output {result.output.strip()!r}")
    counts["launched"] = len(launched)
    assert counts == {"tried": len(CASES), "exit_2": len(CASES), "named": len(CASES), "tracebacks": 0,
                      "launched": 0}, "\n".join(wrong)
    assert len(CASES) >= 40


def test_the_base_config_is_valid():
    """The replay breaks one thing at a time: the file it starts from passes."""
    assert cli.load_config(BASE).instances.num_instances == 2


def _model_dir(tmp_path: Path) -> Path:
    """An HF directory of 12 query heads and 3 KV heads (and a weights file, for the presence check)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 192, "num_attention_heads": 12,
        "num_key_value_heads": 3, "num_hidden_layers": 2, "intermediate_size": 384, "vocab_size": 256}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_every_model_that_does_not_shard_exits_1_before_ray_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from disagg.cluster.launch import bootstrap

    reached = []

    def connect(config):
        reached.append(config.path)
        raise cli.typer.Exit(99)

    monkeypatch.setattr(bootstrap, "connect", connect)  # no case may get this far
    model_dir = str(_model_dir(tmp_path))
    runner = CliRunner()
    counts = {"tried": 0, "exit_1": 0, "named": 0, "tracebacks": 0, "reached_ray": 0}
    wrong = []
    for name, (change, expected) in UNSHARDED.items():
        if "set" in change and isinstance(change["set"], list):
            change = {"set": [(key, model_dir if value == MODEL_DIR else value) for key, value in change["set"]]}
        path = _write(tmp_path, name, change)
        result = runner.invoke(cli.app, ["check", str(path)])
        counts["tried"] += 1
        counts["exit_1"] += result.exit_code == 1
        named = expected in result.output and f"{path}: PreflightError: " in result.output
        counts["named"] += named
        counts["tracebacks"] += "Traceback" in result.output or (
            result.exception is not None and not isinstance(result.exception, SystemExit))
        if result.exit_code != 1 or not named:
            wrong.append(f"{name}: exit {result.exit_code}, output {result.output.strip()!r}")
    counts["reached_ray"] = len(reached)
    assert counts == {"tried": len(UNSHARDED), "exit_1": len(UNSHARDED), "named": len(UNSHARDED), "tracebacks": 0,
                      "reached_ray": 0}, "\n".join(wrong)
    result = runner.invoke(cli.app, ["check", str(_write(tmp_path, "tp 2 shards", _set("instances.tensor_parallel", 2)))])
    assert (result.exit_code, len(reached)) == (99, 1), result.output  # a TP that shards goes on to Ray
