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


def test_run_table_shows_recompute_hits_apart_from_the_hit_rate(summary):
    """A random workload under page pressure: no prompt reuse, but preempted requests find their own
    KV again when they re-enter; that is its own row, out of the hit rate (vLLM's preempted_hits)."""
    result = load_json(summary["runs"][0]["result_files"][0])
    one = {"hit_rate": 0.0, "query_tokens": 6144, "hit_tokens": 0}
    result["prefix_cache"] = {"hit_rate": 0.0, "query_tokens": 12288, "hit_tokens": 0, "pushed_bytes": 0,
                              "instances": {"colocated-0": one, "colocated-1": one},
                              "preempted": {"query_tokens": 49878, "hit_tokens": 12640}}
    table = tables.run_table(result)
    _fits(_render(table))
    rows = dict(zip(table.columns[0].cells, table.columns[1].cells))
    assert rows["Prefix cache hit rate"] == "0.0% (colocated-0 0.0%, colocated-1 0.0%)"
    assert rows["Recompute hits after preemption"] == "12640 of 49878 tokens (their own KV; not in the hit rate)"
    result["prefix_cache"]["preempted"] = {"query_tokens": 0, "hit_tokens": 0}
    assert "Recompute hits after preemption" not in tables.run_table(result).columns[0].cells


def test_each_goodput_is_named_in_its_tables_legend(summary):
    """A run's request goodput (requests meeting the SLOs per second of that run) and the
    comparison's goodput per GPU/instance (the highest rate holding 90%, interpolated) are two
    figures: each table's legend says which it shows and how it differs from the other."""
    run = " ".join(_render(tables.run_table(load_json(summary["runs"][0]["result_files"][0]))).split())
    assert "Request goodput (vLLM's): the requests of one run that met every SLO, per second of that run, " \
           "at its offered rate." in run
    assert "A comparison's goodput per instance is another figure: the highest offered rate per instance at " \
           "which >= 90% of the requests meet every SLO, interpolated between the last rate run that held and " \
           "the first that missed." in run
    text = _render(tables.comparison_table(summary))
    _fits(text)
    flat = " ".join(text.split())
    assert "Goodput here: the highest offered rate per instance at which >= 90% of the requests meet every " \
           "SLO, interpolated between" in flat
    assert "(not a run's request goodput: the requests of one run that met every SLO" in flat


def test_a_ratio_of_two_open_bounds_reads_as_none_with_its_reason(summary):
    """Every deployment held both rates ("200.0+" each): no ratio ("-", explained), not 1.000."""
    text = _render(tables.comparison_table(summary))
    assert "1.000" not in text and re.search(r"│ +- A/[BC] │", text), text
    assert "'-': the sweep cannot order them (both held every rate, or both missed the lowest)" in \
        " ".join(text.split())
    assert tables.fmt_ratio({"ratio": 2.0, "ratio_bound": "at_least"}) == ">=2.000"
    assert tables.fmt_ratio({"ratio": 0.5, "ratio_bound": "at_most"}) == "<=0.500"


def test_common_rate_table_says_which_rate_it_is(summary):
    flat = " ".join(_render(tables.common_rate_table(summary)).split())
    assert "The rate: the highest rate every deployment ran at while each held >= 50% SLO attainment." in flat
    common = {label: dict(row, attainment=0.25) if isinstance(row, dict) else row
              for label, row in summary["at_common_rate"].items()}
    text = _render(tables.common_rate_table(dict(summary, at_common_rate=common)))
    _fits(text)
    flat = " ".join(text.split())
    assert "The rate: the lowest rate every deployment ran (at no rate they all ran did each hold >= 50% SLO " \
           "attainment)." in flat and "highest" not in flat
