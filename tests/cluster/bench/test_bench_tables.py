"""Every console table of the bench renders in 80 columns with nothing cut ('…'), names its
deployments, rate and SLOs in words, and explains its marks; from a real (stand-in) comparison."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from disagg.cluster.bench import tables
from disagg.cluster.bench.report import load_json
from disagg.cluster.bench.sweep import SweepOptions, compare_configs
from stand_in import TINY_1P1D, TINY_COLOCATED


def _render(renderable) -> str:
    console = Console(width=80, record=True, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def _fits(text: str) -> None:
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text


@pytest.fixture(scope="module")
def summary(stand_in_module, tmp_path_factory):
    """Three deployments with long labels (a variant sweep), two rates: one comparison (~1.3 s) that
    every test of the module renders."""
    options = SweepOptions(num_prompts=4, rates=[100.0, 400.0], input_len=6, output_len=3,
                           goodput_slos_ms={"ttft": 500.0, "tpot": 50.0}, show_progress=False)
    return compare_configs(TINY_1P1D, [TINY_COLOCATED], tmp_path_factory.mktemp("compare"), options,
                           variants=[{"scheduler.max_num_batched_tokens": 64},
                                     {"scheduler.max_num_batched_tokens": 128}])


def test_run_table_fits_80_columns(summary):
    result = load_json(summary["runs"][2]["result_files"][0])
    text = _render(tables.run_table(result))
    _fits(text)
    assert "tiny-colocated[max_num_batched_tokens=128]: workload random, 100 req/s offered, 4 requests" in \
        " ".join(text.split())
    assert "Request goodput (req/s) (TTFT 500 ms, TPOT 50 ms)" in text and "SLO attainment" in text


def test_comparison_table_fits_and_explains_itself(summary):
    text = _render(tables.comparison_table(summary))
    _fits(text)
    flat = " ".join(text.split())
    assert "A = tiny-1p1d (2 instances on the CPU), B = tiny-colocated[max_num_batched_tokens=64]" in flat
    assert "C = tiny-colocated[max_num_batched_tokens=128]" in flat
    assert "Base SLOs: TTFT 500 ms, TPOT 50 ms" in flat and "'+': every rate swept held the target" in flat
    assert "Goodput per instance" in flat and "{" not in flat          # no Python dict in a title
    assert "200.0+" in text and re.search(r" A/[BC] ", text)


def test_common_rate_table_fits_with_busy_fractions(summary):
    text = _render(tables.common_rate_table(summary))
    _fits(text)
    flat = " ".join(text.split())
    assert "At a common rate: 400 req/s offered to each" in flat
    assert "colocated-0 " in text and "disaggregated-1 " in text and "GPU util" in text


def test_failure_lines_and_slo_lines_read_without_the_source():
    result = {"successes": [False, False, True, False], "errors": ["HTTP 401: no key", "HTTP 401: no key", "",
                                                                   "ReadTimeout: server went away"]}
    assert tables.failure_lines(result) == ["3 of 4 requests failed:", "  2 x HTTP 401: no key",
                                            "  1 x ReadTimeout: server went away"]
    assert tables.failure_lines({"successes": [True], "errors": [""]}) == []
    assert "no SLOs" in tables.slo_line("random", None, None) and "None" not in tables.slo_line("random", {}, None)
    assert tables.slo_line("chat", {"ttft": 500.0, "tpot": 50.0}, None) == "workload chat: SLOs TTFT 500 ms, TPOT 50 ms"
