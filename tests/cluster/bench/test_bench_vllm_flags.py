"""`disagg bench` as a `vllm bench serve` user types it, and how it ends: vLLM's flag forms
(`--goodput ttft:500 tpot:50`, `--metadata k=v k2=v2`, `--host/--port`, OPENAI_API_KEY), its
options with no meaning here refused with a hint, a keyed server without the key as one line and
exit 1, a run where every request failed as its reasons and exit 1, and comparisons of different
models refused. Deployments are `StandInCluster`s; servers are the real serve app over ASGI."""

from __future__ import annotations

import re

import httpx
import pytest
from stand_in import TINY_1P1D, TINY_COLOCATED, StandInCluster, bench_app
from typer.testing import CliRunner

from disagg.cluster.bench import backends
from disagg.cluster.bench.backends import HttpBackend
from disagg.cluster.bench.report import load_json
from disagg.cluster.serve.app import build_app
from disagg.config import Config

SMALL = ["--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--request-rate", "inf", "--disable-tqdm"]


def _invoke(*args: str, env: dict | None = None):
    result = CliRunner().invoke(bench_app(), ["bench", *args], env={"COLUMNS": "80", **(env or {})})
    return result, " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


@pytest.fixture
def keyed_server(monkeypatch):
    """The serve app over a StandInCluster, requiring key "k": every HttpBackend goes to it; the
    requests it got are listed in the returned list."""
    config = Config.from_yaml(TINY_1P1D).override({"serve.api_key": "k"})
    cluster = StandInCluster(config)
    cluster.model_name, cluster.tokenizer, cluster.healthy = "tiny", None, True
    seen = []
    app = build_app(cluster, config)

    async def recording(scope, receive, send):
        if scope["type"] == "http":
            seen.append((scope["path"], dict(scope["headers"])))
        await app(scope, receive, send)

    transport = httpx.ASGITransport(app=recording)
    real = backends.HttpBackend
    monkeypatch.setattr(backends, "HttpBackend", lambda url, **kw: real(url, transport=transport, **kw))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    return seen


def test_goodput_and_metadata_in_vllm_form(stand_in, tmp_path):
    result, text = _invoke(TINY_1P1D, "--no-compare", *SMALL, "--goodput", "ttft:500", "tpot:50",
                           "--metadata", "version=0.3.3", "tp=1", "--save-result", "--result-dir", str(tmp_path),
                           "--ignore-eos", "--save-detailed", "--trust-remote-code")
    assert result.exit_code == 0, result.output
    (saved,) = [load_json(p) for p in tmp_path.glob("tiny-1p1d-infqps-*.json")]
    assert saved["goodput"] == {"ttft": 500.0, "tpot": 50.0}
    assert (saved["version"], saved["tp"]) == ("0.3.3", "1")
    assert (saved["model_id"], saved["tokenizer_id"], saved["dtype"]) == ("dummy:tiny", "dummy:tiny", "float32")
    assert "SLOs TTFT 500 ms, TPOT 50 ms" in text
    summary = (tmp_path / "summary.md").read_text()  # a single config gets its summary.md too
    assert "- model: dummy:tiny (float32)" in summary and "| random | inf | 3 | 0 |" in summary


def test_config_positional_after_greedy_goodput(stand_in, tmp_path):
    result, _ = _invoke("--goodput", "ttft:500", "tpot:50", TINY_1P1D, "--no-compare", *SMALL)
    assert result.exit_code == 0, result.output
    assert len(stand_in.launched) == 1


def test_api_key_from_the_flag_or_openai_api_key(keyed_server, tmp_path):
    for extra, env in ((["--api-key", "k"], {}), ([], {"OPENAI_API_KEY": "k"})):
        keyed_server.clear()
        result, _ = _invoke("--host", "serve.test", "--port", "8000", "--vocab-size", "64", *SMALL, *extra,
                            "--header", "x-tenant=a", "--save-result", "--result-dir", str(tmp_path), env=env)
        assert result.exit_code == 0, result.output
        assert {path for path, _ in keyed_server} == {"/v1/models", "/v1/completions", "/reset_prefix_cache"}
        assert all(headers[b"authorization"] == b"Bearer k" and headers[b"x-tenant"] == b"a"
                   for _, headers in keyed_server)
    saved = load_json(next(tmp_path.glob("*.json")))
    assert saved["base_url"] == "http://serve.test:8000" and saved["model_id"] == "tiny"


def test_keyed_server_without_the_key_is_one_line_and_exit_1(keyed_server):
    result, _ = _invoke("--base-url", "http://serve.test", "--vocab-size", "64", *SMALL)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "HTTP 401" in lines[0] and "no API key provided" in lines[0] and "--api-key" in lines[0]
    assert [path for path, _ in keyed_server] == ["/v1/models"]          # no run was started


def test_a_run_where_every_request_failed_exits_1_with_the_reasons(keyed_server, monkeypatch):
    async def skip_check(self, ready_timeout_s=0.0):  # a server that lists models without a key
        return None
    monkeypatch.setattr(HttpBackend, "check", skip_check)
    result, text = _invoke("--base-url", "http://serve.test", "--model", "tiny", "--vocab-size", "64", *SMALL)
    assert result.exit_code == 1, result.output
    assert "Successful requests 0" in text and "Failed requests 3" in text and "Mean TTFT" not in text
    assert "3 of 3 requests failed:" in text and "3 x HTTP 401: no API key provided" in text
    assert "no request succeeded (3 failed in 1 run(s); reasons above)" in text


@pytest.mark.parametrize("args, words", [
    (["--dataset-path", "x.json"], "no dataset files"),
    (["--temperature", "0.7"], "decodes greedily"),
    (["--top-k", "5"], "decodes greedily"),
    (["--ramp-up-strategy", "linear"], "--request-rate 1,2,4,8"),
    (["--sharegpt-output-len", "64"], "--output-len"),
    (["--use-beam-search"], "not supported"),
    (["--append-result"], "dated"),
    (["--profile"], "not supported"),
    (["--backend", "openai-chat"], "openai or vllm"),
    (["--percentile-metrics", "ttft,client_queue_time"], "ttft,tpot,itl,e2el"),
    (["--goodput", "ttft=500"], "NAME:MILLISECONDS"),
    (["--metadata", "version"], "KEY=VALUE"),
    (["--base-url", "http://x", "--host", "y"], "not both"),
])
def test_vllm_options_without_a_meaning_here_exit_2(stand_in, args, words):
    result, text = _invoke(TINY_1P1D, *args)
    assert result.exit_code == 2 and words in text, result.output
    assert not stand_in.launched and "Traceback" not in result.output


def test_different_models_are_refused_unless_allowed(stand_in, tmp_path):
    smol = tmp_path / "smol.yaml"
    smol.write_text(open(TINY_COLOCATED).read().replace("float32", "bfloat16"))
    result, text = _invoke(TINY_1P1D, "--compare", str(smol), *SMALL, "--result-dir", str(tmp_path / "a"))
    assert result.exit_code == 2 and "dtype: tiny-1p1d runs 'float32', smol runs 'bfloat16'" in text, text
    assert not stand_in.launched
    result, text = _invoke(TINY_1P1D, "--compare", str(smol), *SMALL, "--request-rate", "100",
                           "--result-dir", str(tmp_path / "b"), "--allow-mismatch")
    assert result.exit_code == 0, result.output
    assert "WARNING: comparing deployments that differ: dtype" in text
    assert "WARNING: the deployments differ: dtype" in (tmp_path / "b" / "summary.md").read_text()


def test_stored_results_of_different_workloads_are_refused(stand_in, tmp_path):
    for lens, folder in (("4", "a"), ("8", "b")):
        config = TINY_1P1D if folder == "a" else TINY_COLOCATED
        result, _ = _invoke(config, "--no-compare", "--num-prompts", "3", "--input-len", lens, "--output-len", "2",
                            "--request-rate", "100", "--goodput", "ttft:500", "--save-result", "--disable-tqdm",
                            "--result-dir", str(tmp_path / folder))
        assert result.exit_code == 0, result.output
    result, text = _invoke("--from-results", str(tmp_path / "a"), "--from-results", str(tmp_path / "b"),
                           "--result-dir", str(tmp_path / "ab"))
    assert result.exit_code == 2 and "workload: tiny-1p1d runs {" in text and "input_len 4" in text, text


def test_a_max_model_len_that_clips_nothing_is_not_a_workload_difference():
    from disagg.cluster.bench.compare import setup_mismatches

    work = {"dataset_name": "chat", "input_len": 40, "output_len": 4, "range_ratio": 0.5}
    same = setup_mismatches({"a": {"workload": {**work, "max_model_len": 2048}},
                             "b": {"workload": {**work, "max_model_len": 4096}}})
    assert same == []
    clipped = setup_mismatches({"a": {"workload": {**work, "max_model_len": 50}},
                                "b": {"workload": {**work, "max_model_len": 4096}}})
    assert clipped and clipped[0].startswith("workload: a runs")
