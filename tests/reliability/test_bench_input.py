"""Replay of bad `disagg bench` input, in process (typer's CliRunner), with counts per class.

Classes: `--goodput` in forms that are not NAME:MILLISECONDS (vLLM's own form passes); vLLM
options with no meaning here (each refused, exit 2, with what to use instead, before anything
launches); a keyed server benchmarked without its key (one line naming HTTP 401, exit 1, no run
started); runs where every request failed (each reason printed with its count, exit 1). No case
may print a Python traceback. Deployments are stand-in clusters; the server is the real serve
app over ASGI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster" / "bench"))

import disagg.cluster  # noqa: E402
from disagg.cluster.bench import backends  # noqa: E402
from disagg.cluster.bench.backends import HttpBackend  # noqa: E402
from disagg.cluster.serve.app import build_app  # noqa: E402
from disagg.cluster.serve.vllm_options import BENCH_REFUSED  # noqa: E402
from disagg.config import Config  # noqa: E402
from stand_in import TINY_1P1D, StandInCluster, bench_app  # noqa: E402

SMALL = ["--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--request-rate", "inf", "--disable-tqdm"]

BAD_GOODPUT = {  # --goodput values -> words the message must hold
    "equals sign": (["ttft=500"], "NAME:MILLISECONDS"),
    "no value": (["ttft:"], "expects a number of milliseconds"),
    "word value": (["tpot:fast"], "'fast'"),
    "unknown metric": (["itl:5"], "ttft"),
    "negative": (["ttft:-1"], ">= 0"),
    "infinite": (["e2el:inf"], "finite"),
    "one good one bad": (["ttft:500", "tpot:x"], "'x'"),
    "comma list with a bad one": (["ttft:500,latency:3"], "'latency'"),
}
GOOD_GOODPUT = {  # vLLM's forms and ours: all the same SLOs
    "vLLM nargs": ["--goodput", "ttft:500", "tpot:50"],
    "repeated flag": ["--goodput", "ttft:500", "--goodput", "tpot:50"],
    "one quoted value": ["--goodput", "ttft:500 tpot:50"],
    "equals form then nargs": ["--goodput=ttft:500", "tpot:50"],
}


def _refused_cases() -> dict[str, list[str]]:
    cases = {}
    for option in BENCH_REFUSED:
        for name in option.names:
            cases[name] = [name] if option.is_flag else [name, "1"]
    return cases


REFUSED = _refused_cases()


@pytest.fixture
def stand_in(monkeypatch):
    StandInCluster.launched = []
    monkeypatch.setattr(disagg.cluster, "Cluster", StandInCluster, raising=False)
    return StandInCluster


def _invoke(*args: str, env: dict | None = None):
    result = CliRunner().invoke(bench_app(), ["bench", *args], env={"COLUMNS": "80", **(env or {})})
    return result, " ".join(result.output.replace("│", " ").split())


def test_bad_goodput_forms(stand_in):
    refused = 0
    for name, (values, words) in BAD_GOODPUT.items():
        result, text = _invoke(TINY_1P1D, "--goodput", *values)
        assert result.exit_code == 2 and words in text and "--goodput" in text, (name, result.output)
        assert "Traceback" not in result.output
        refused += 1
    assert refused == len(BAD_GOODPUT) == 8 and not stand_in.launched


def test_vllm_goodput_forms_all_mean_the_same(stand_in, tmp_path):
    for index, (name, args) in enumerate(GOOD_GOODPUT.items()):
        folder = tmp_path / str(index)
        result, _ = _invoke(TINY_1P1D, "--no-compare", *SMALL, *args, "--save-result", "--result-dir", str(folder))
        assert result.exit_code == 0, (name, result.output)
        from disagg.cluster.bench.report import load_json

        (saved,) = [load_json(p) for p in folder.glob("*qps-*.json")]
        assert saved["goodput"] == {"ttft": 500.0, "tpot": 50.0}, name
    assert len(stand_in.launched) == len(GOOD_GOODPUT) == 4


def test_refused_vllm_options(stand_in):
    for name, args in REFUSED.items():
        option = next(o for o in BENCH_REFUSED if name in o.names)
        result, text = _invoke(TINY_1P1D, *args)
        assert result.exit_code == 2, (name, result.output)
        assert " ".join(option.hint.split()) in text, (name, text)
        assert "Traceback" not in result.output
    assert len(REFUSED) == 28 and not stand_in.launched


@pytest.fixture
def keyed(monkeypatch):
    """Every HttpBackend talks to the serve app (key "k") over a StandInCluster."""
    config = Config.from_yaml(TINY_1P1D).override({"serve.api_key": "k"})
    cluster = StandInCluster(config)
    cluster.model_name, cluster.tokenizer, cluster.healthy = "tiny", None, True
    transport = httpx.ASGITransport(app=build_app(cluster, config))
    monkeypatch.setattr(backends, "HttpBackend", lambda url, **kw: HttpBackend(url, transport=transport, **kw))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


WITHOUT_KEY = {
    "no key, model asked of the server": [],
    "no key, --model given": ["--model", "tiny"],
    "wrong --api-key": ["--api-key", "nope"],
    "wrong OPENAI_API_KEY": ["env:nope"],
}


def test_keyed_server_without_the_key(keyed):
    for name, extra in WITHOUT_KEY.items():
        env = {"OPENAI_API_KEY": extra[0][4:]} if extra and extra[0].startswith("env:") else {}
        args = [] if env else extra
        result, _ = _invoke("--base-url", "http://serve.test", "--vocab-size", "64", *SMALL, *args, env=env)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1, (name, result.output)
        assert lines[0].startswith("disagg bench: http://serve.test/v1/models answered HTTP 401:"), (name, lines)
        assert "--api-key" in lines[0] and "OPENAI_API_KEY" in lines[0]
    assert len(WITHOUT_KEY) == 4


def test_runs_where_every_request_failed(keyed, monkeypatch):
    async def listed_without_a_key(self, ready_timeout_s=0.0):  # a server whose /v1/models is open
        return None
    monkeypatch.setattr(HttpBackend, "check", listed_without_a_key)
    cases = {"one rate": "inf", "two rates": "100,inf"}
    for name, rates in cases.items():
        result, text = _invoke("--base-url", "http://serve.test", "--model", "tiny", "--vocab-size", "64",
                               *SMALL, "--request-rate", rates)
        num_runs = len(rates.split(","))
        assert result.exit_code == 1, (name, result.output)
        assert text.count("3 of 3 requests failed: 3 x HTTP 401: no API key provided") == num_runs, (name, text)
        assert f"no request succeeded ({3 * num_runs} failed in {num_runs} run(s); reasons above)" in text
        assert "Traceback" not in result.output
    assert len(cases) == 2
