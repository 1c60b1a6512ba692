"""disagg.config: every shipped YAML validates; malformed files fail naming file, field and fix."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from disagg.config import Config
from disagg.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny-1p1d.yaml"


def write(tmp_path: Path, raw: dict, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def tiny_raw() -> dict:
    return yaml.safe_load(TINY.read_text())


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path):
    config = Config.from_yaml(path)
    assert config.path == str(path)
    assert config.instances.num_instances >= 1


def test_tiny_configs_are_the_ci_pair():
    one, colo = Config.from_yaml(TINY), Config.from_yaml(CONFIGS / "tiny-colocated.yaml")
    assert (one.mode, colo.mode) == ("disaggregated", "colocated")
    assert one.model == colo.model and one.cache == colo.cache
    assert one.instances.num_instances == colo.instances.num_instances == 2
    assert one.instances.device == "cpu" and one.transfer.backend == "shm"


def test_four_gpu_configs_are_one_family():
    """The four-GPU splits and their colocated baseline differ only in the split (FOURGPU.md)."""
    names = ["2p2d", "1p3d", "3p1d", "colocated-4"]
    configs = {name: Config.from_yaml(CONFIGS / f"llama3-8b-{name}.yaml") for name in names}
    base = configs["colocated-4"]
    splits = {name: (c.instances.prefill, c.instances.decode, c.instances.colocated) for name, c in configs.items()}
    assert splits == {"2p2d": (2, 2, 0), "1p3d": (1, 3, 0), "3p1d": (3, 1, 0), "colocated-4": (0, 0, 4)}
    for config in configs.values():
        assert config.instances.num_instances == 4 and config.instances.device == "cuda"
        assert (config.model, config.scheduler) == (base.model, base.scheduler)
        assert config.cache.page_size == base.cache.page_size
    for name in ("1p3d", "3p1d"):
        assert configs[name].bench.compare_with == str((CONFIGS / "llama3-8b-colocated-4.yaml").resolve())
        assert configs[name].transfer.backend == "nvshmem"


def test_llama31_configs_hold_the_long_prompt_workload():
    """The 8k-32k long-prompt workload fits unclipped: max_model_len and the preset's context."""
    from disagg.cluster.bench.workloads import WorkloadSpec, sample_requests
    from disagg.model.presets import preset_config

    one, colo = (Config.from_yaml(CONFIGS / f"llama3.1-8b-{name}.yaml") for name in ("1p1d", "colocated"))
    assert one.model == colo.model and one.model.source == "dummy:llama3.1-8b"
    assert (one.mode, colo.mode) == ("disaggregated", "colocated")
    assert one.scheduler == colo.scheduler and one.cache == colo.cache
    limit = one.model.max_model_len
    assert 32768 + 64 <= limit <= preset_config("llama3.1-8b").max_position_embeddings

    def lengths(max_model_len):
        spec = WorkloadSpec("long-prompt", num_prompts=64, vocab_size=1000, max_model_len=max_model_len)
        return [(len(r.prompt_token_ids), r.expected_output_len) for r in sample_requests(spec)]
    unclipped = lengths(None)
    assert max(n for n, _ in unclipped) > 30000 and lengths(limit) == unclipped
    assert lengths(8192) != unclipped  # what llama3-8b's context did to it


def test_unknown_key_suggests_the_closest(tmp_path: Path):
    raw = tiny_raw()
    raw["cache"]["page_sise"] = 16
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    message = str(info.value)
    assert str(path) in message
    assert "cache.page_sise: unknown key; did you mean 'page_size'?" in message


def test_unknown_section_suggests_the_closest(tmp_path: Path):
    raw = tiny_raw()
    raw["routr"] = {"lease_s": 3}
    with pytest.raises(ConfigError, match=r"routr: unknown key; did you mean 'router'\?"):
        Config.from_yaml(write(tmp_path, raw))


def test_bad_type_names_the_field_and_the_value(tmp_path: Path):
    raw = tiny_raw()
    raw["scheduler"]["max_num_seqs"] = "many"
    with pytest.raises(ConfigError, match=r"scheduler\.max_num_seqs: .*integer.*\(got 'many'\)"):
        Config.from_yaml(write(tmp_path, raw))


def test_bad_enum_lists_the_choices(tmp_path: Path):
    raw = tiny_raw()
    raw["model"]["dtype"] = "fp16"
    with pytest.raises(ConfigError, match=r"model\.dtype: .*'bfloat16'.*\(got 'fp16'\)"):
        Config.from_yaml(write(tmp_path, raw))


@pytest.mark.parametrize("instances, expected", [
    ({"prefill": 0, "decode": 1}, "prefill >= 1 and decode >= 1"),
    ({"prefill": 1, "decode": 0}, "prefill >= 1 and decode >= 1"),
    ({}, "prefill >= 1 and decode >= 1"),
    ({"colocated": 2, "decode": 1}, "colocated .2. excludes prefill"),
    ({"colocated": -1}, "greater than or equal to 0"),
])
def test_instance_counts(tmp_path: Path, instances: dict, expected: str):
    raw = tiny_raw()
    raw["instances"] = dict(instances, device="cpu")
    with pytest.raises(ConfigError, match=rf"instances.*{expected}"):
        Config.from_yaml(write(tmp_path, raw))


@pytest.mark.parametrize("page_size", [0, 12, 512])
def test_page_size_must_be_sane(tmp_path: Path, page_size: int):
    raw = tiny_raw()
    raw["cache"]["page_size"] = page_size
    with pytest.raises(ConfigError, match=r"cache"):
        Config.from_yaml(write(tmp_path, raw))


def test_mismatched_geometry_pages_cannot_hold_one_sequence(tmp_path: Path):
    raw = tiny_raw()
    raw["model"]["max_model_len"] = 8192
    raw["cache"]["num_pages"] = 16
    with pytest.raises(ConfigError, match=r"cache.num_pages \(16\) holds fewer than one sequence"):
        Config.from_yaml(write(tmp_path, raw))


def test_num_pages_and_kv_bytes_exclusive(tmp_path: Path):
    raw = tiny_raw()
    raw["cache"]["kv_bytes"] = 1 << 20
    with pytest.raises(ConfigError, match=r"cache: .*num_pages .*or kv_bytes"):
        Config.from_yaml(write(tmp_path, raw))


def test_gpu_only_options_refused_on_cpu(tmp_path: Path):
    raw = tiny_raw()
    raw["transfer"]["backend"] = "nvshmem"
    with pytest.raises(ConfigError, match=r"nvshmem needs GPUs"):
        Config.from_yaml(write(tmp_path, raw))


def test_missing_file_and_bad_yaml(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        Config.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "broken.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:2:1: not valid YAML"):
        Config.from_yaml(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: expected a mapping"):
        Config.from_yaml(bad)


def test_a_yaml_syntax_error_names_the_file_line_and_column_and_quotes_the_line(tmp_path: Path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("model:\n  source: dummy:tiny\ninstances:\n  prefill: 1\n   decode: 1\n")
    with pytest.raises(ConfigError) as caught:
        Config.from_yaml(bad)
    first, quoted, caret = str(caught.value).splitlines()
    assert first == f"{bad}:5:10: not valid YAML: mapping values are not allowed here"
    assert quoted == "    5 |    decode: 1" and caret == "      |          ^"
    assert "<unicode string>" not in str(caught.value)
    bad.write_text("model:\n  source: dummy:tiny\ninstances:\n  prefill: 1\n  decode: [1\n")
    with pytest.raises(ConfigError) as caught:  # at the end of the file: the context's line is quoted
        Config.from_yaml(bad)
    assert str(caught.value).splitlines() == [
        f"{bad}:6:1: not valid YAML: expected ',' or ']', but got '<stream end>' (while parsing a flow "
        "sequence at line 5, column 11)", "    5 |   decode: [1", "      |           ^"]
    bad.write_text("model:\n\tsource: dummy:tiny\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml:2:1: .*YAML indents with spaces, never tabs"):
        Config.from_yaml(bad)
    bad.write_bytes(b"model:\n  source: \xff\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml: cannot read the config: not UTF-8 text"):
        Config.from_yaml(bad)


def test_override_validates_and_keeps_the_path():
    config = Config.from_yaml(TINY)
    changed = config.override({"router.lease_s": 2, "instances.decode": 3})
    assert (changed.router.lease_s, changed.instances.decode, changed.path) == (2.0, 3, str(TINY))
    assert config.router.lease_s == 30  # the original is unchanged
    with pytest.raises(ConfigError, match=r"router.leas_s: unknown key; did you mean 'lease_s'"):
        config.override({"router.leas_s": 2})
    with pytest.raises(ConfigError, match=r"'routr' is not a section; did you mean 'router'"):
        config.override({"routr.lease_s": 2})


def test_relative_model_source_resolves_next_to_the_file(tmp_path: Path):
    (tmp_path / "weights").mkdir()
    raw = tiny_raw()
    raw["model"]["source"] = "weights"
    config = Config.from_yaml(write(tmp_path, raw, "local.yaml"))
    assert config.model.source == str((tmp_path / "weights").resolve())


def test_import_stays_light():
    code = "import sys, disagg.config; print(any(m.split('.')[0] in ('torch', 'ray') for m in sys.modules))"
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_num_layers_only_for_dummy_presets():
    config = Config.from_yaml(TINY).override({"model.num_layers": 3})
    assert config.model.num_layers == 3
    with pytest.raises(ConfigError, match=r"model: num_layers \(3\) applies to 'dummy:<preset>' sources only"):
        Config.from_yaml(CONFIGS / "smollm2-1p1d.yaml").override({"model.num_layers": 3})


def test_override_keeps_which_fields_were_given():
    config = Config.from_yaml(TINY)  # the file has no serve or bench section
    assert "serve" not in config.model_fields_set and "router" in config.model_fields_set
    changed = config.override({"router.lease_s": 2})
    assert changed.model_fields_set == config.model_fields_set
    assert changed.router.model_fields_set == config.router.model_fields_set  # request_timeout_s stays given
    assert "policy" not in changed.router.model_fields_set
    served = config.override({"serve.port": 9001, "bench.goodput.ttft": 500})
    assert {"serve", "bench"} <= served.model_fields_set and served.serve.model_fields_set == {"port"}
    assert served.serve.host == "127.0.0.1" and served.bench.goodput == {"ttft": 500, "tpot": 100.0}
    with pytest.raises(ConfigError, match=r"'lease_s' is not a section"):
        config.override({"router.lease_s.x": 1})


@pytest.mark.parametrize("section, key, value, expected", [
    ("instances", "prefill", "1", "integer"),       # a string for an int
    ("scheduler", "max_num_seqs", 8.0, "integer"),  # a float for an int
    ("router", "lease_s", "30", "number"),          # a string for a float
    ("transfer", "force_segment_puts", 1, "boolean"),  # an int for a bool
    ("cluster", "warmup", "yes", "boolean"),        # a string for a bool (YAML's unquoted yes is a bool)
])
def test_types_are_strict(tmp_path: Path, section: str, key: str, value, expected: str):
    """A string is never read as a number or a bool, nor a number as a bool: the field, what was
    expected and the value given are named."""
    raw = tiny_raw()
    raw.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match=rf"{section}\.{key}: .*{expected}.*\(got {value!r}\)"):
        Config.from_yaml(write(tmp_path, raw))


def test_ints_for_floats_and_yaml_booleans_still_load(tmp_path: Path):
    path = tmp_path / "ok.yaml"
    path.write_text(TINY.read_text() + "cluster:\n  warmup: no\n  startup_timeout_s: 60\n")
    config = Config.from_yaml(path).override({"router.lease_s": 30, "bench.request_rates": [1, 2]})
    assert config.router.lease_s == 30.0 and isinstance(config.router.lease_s, float)
    assert config.cluster.warmup is False and config.cluster.startup_timeout_s == 60.0
    assert config.bench.request_rates == [1.0, 2.0]


@pytest.mark.parametrize("text, key, line, first", [
    ("model:\n  source: dummy:tiny\nmodel:\n  source: dummy:tiny\n", "model", 3, 1),
    ("router:\n  lease_s: 30\n  lease_s: 5\n", "router.lease_s", 3, 2),
    ("bench:\n  goodput: {ttft: 1, tpot: 2, ttft: 3}\n", "bench.goodput.ttft", 2, 2),
])
def test_a_key_given_twice_is_refused_with_its_path_and_lines(tmp_path: Path, text: str, key: str,
                                                                line: int, first: int):
    """YAML's safe_load keeps the last of two equal keys without a word; the config refuses it."""
    path = tmp_path / "twice.yaml"
    path.write_text(text + "instances: {prefill: 1, decode: 1, device: cpu}\n"
                    + ("" if text.startswith("model") else "model: {source: 'dummy:tiny'}\n"))
    with pytest.raises(ConfigError, match=rf"twice\.yaml: line {line}: {key} given twice \(first at line {first}\)"):
        Config.from_yaml(path)


def test_yaml_anchors_and_merge_keys_still_load(tmp_path: Path):
    """Merge keys override on purpose (not a key given twice); aliases are not walked twice."""
    path = tmp_path / "anchors.yaml"
    path.write_text("model: {source: 'dummy:tiny'}\n"
                    "instances:\n  <<: &counts {prefill: 1, decode: 1}\n  decode: 2\n  device: cpu\n"
                    "bench:\n  options: {a: *counts, b: *counts}\n")
    config = Config.from_yaml(path)
    assert (config.instances.prefill, config.instances.decode) == (1, 2)
    assert config.bench.options == {"a": {"prefill": 1, "decode": 1}, "b": {"prefill": 1, "decode": 1}}


@pytest.mark.parametrize("source", ["", "   "])
def test_empty_model_source_is_refused_not_turned_into_the_folder(tmp_path: Path, source: str):
    raw = tiny_raw()
    raw["model"]["source"] = source
    with pytest.raises(ConfigError, match=r"model\.source: expected an HF directory.*not an empty or blank"):
        Config.from_yaml(write(tmp_path, raw))
    raw["model"]["source"] = "dummy:tiny"
    raw["bench"] = {"compare_with": source}
    with pytest.raises(ConfigError, match=r"bench\.compare_with: .*not an empty or blank"):
        Config.from_yaml(write(tmp_path, raw))


def test_phase_split_off_is_accepted_as_yaml_writes_it_and_sm_is_refused_with_the_reason(tmp_path: Path):
    path = tmp_path / "split.yaml"
    raw = TINY.read_text()
    assert "scheduler:" in raw
    path.write_text(raw.replace("scheduler:", "scheduler:\n  phase_split: off", 1))  # YAML 1.1: false
    assert Config.from_yaml(path).scheduler.phase_split == "off"
    for value in ("sm", "auto"):
        path.write_text(raw.replace("scheduler:", f"scheduler:\n  phase_split: {value}", 1))
        with pytest.raises(ConfigError, match=r"scheduler\.phase_split: expected 'off', got '" + value
                           + r"': SM partitions of one GPU are not built .*benchmarks/records/phase-split-2026-11-27"):
            Config.from_yaml(path)


def _documented_fields(section: str) -> set[str]:
    """The backticked first cells of the table under ``### section`` of docs/deployment.md."""
    text = (CONFIGS.parent / "docs" / "deployment.md").read_text()
    body = text.split(f"\n### {section}", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([a-z_0-9]+)` \|", body, re.M))


@pytest.mark.parametrize("section", sorted(Config.model_fields))
def test_every_schema_field_is_documented_in_deployment_md(section: str):
    fields = set(Config.model_fields[section].annotation.model_fields)
    assert fields == _documented_fields(section), (
        f"docs/deployment.md's {section} table: missing {sorted(fields - _documented_fields(section))}, "
        f"not in the schema {sorted(_documented_fields(section) - fields)}")


@pytest.mark.parametrize("doc", ["README.md", "docs/deployment.md"])
def test_every_shipped_config_is_in_the_configs_tables(doc: str):
    text = (CONFIGS.parent / doc).read_text()
    listed = set(re.findall(r"`([a-z0-9.-]+)`", "\n".join(line for line in text.splitlines()
                                                          if line.startswith("| `"))))
    missing = sorted(path.stem for path in CONFIGS.glob("*.yaml") if path.stem not in listed)
    assert not missing, f"{doc}: configs/ holds {missing}, which its configs table does not list"
