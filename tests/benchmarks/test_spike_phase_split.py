"""CPU checks of the phase-split spike (benchmarks/spike_phase_split.py): its window metrics, the
issue's go/no-go rule, and its host loops on the tiny model (mixed rows through the real colocated
engine, split rows without partitions), which must hand back every slot and page they take."""

from __future__ import annotations

import json
import sys

import pytest



@pytest.fixture(scope="module")
def spike(benchmark_script):
    return benchmark_script("spike_phase_split")


def test_window_metrics_counts_tokens_inside_and_gaps_across_the_window(spike):
    times = {"a": [0.5, 1.5, 2.0, 3.5], "b": [0.9, 3.2]}  # the window is (1.0, 3.0]
    m = spike.window_metrics(times, 1.0, 3.0, prompt_len=100)
    assert m["decode_tokens"] == 2  # a@1.5, a@2.0
    assert m["window_ms"] == pytest.approx(2000.0)
    assert m["decode_tok_s"] == pytest.approx(1.0)
    assert m["longest_gap_ms"] == pytest.approx(2300.0)  # b: 0.9 -> 3.2 spans the window
    assert m["prefill_tok_s"] == pytest.approx(50.0)


def _row(name, decode, gap, prefill, **extra):
    return {"name": name, "decode_tok_s": decode, "longest_gap_ms": gap, "prefill_tok_s": prefill, **extra}


def test_verdict_follows_the_issue_rule(spike):
    mixed = [_row("mixed_chunk512", 1000, 40, 5000), _row("mixed_chunk2048", 1200, 100, 9000)]
    best = mixed[1]  # most decode tokens/s: every threshold comes from it
    go = _row("split_N32", 1.5 * best["decode_tok_s"], 50, 0.7 * best["prefill_tok_s"], num_sms=32)
    v = spike.verdict(mixed, [go])
    assert v["go"] is True and v["best_mixed"] == "mixed_chunk2048" and v["passing"] == ["split_N32"]
    assert v["strict"]["passing"] == []  # 50 ms is more than half of chunk 512's 40 ms gap
    for bad in (dict(decode_tok_s=1.49 * 1200), dict(longest_gap_ms=51), dict(prefill_tok_s=0.69 * 9000)):
        assert spike.verdict(mixed, [{**go, **bad}])["go"] is False, bad
    assert spike.verdict(mixed, [{"name": "split_N16", "error": "no GreenContext"}])["go"] is None


def test_cpu_run_writes_json_and_hands_back_every_slot(spike, tmp_path, capsys, monkeypatch):
    # The script's host loops are under test: the kernels run their torch references (in Triton's
    # interpreter, tested on their own under it, a forward cost ~0.3 s and this run ~6 s).
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(spike, "WARM_STEPS", 1)
    monkeypatch.setattr(spike, "WARM_WINDOWS", 0)
    out = tmp_path / "spike.json"
    rc = spike.main(["--device", "cpu", "--model", "dummy:tiny", "--num-decodes", "2", "--context", "16",
                     "--prompt", "8", "--chunks", "8", "--split-chunk", "8", "--decode-room", "32",
                     "--split-on-cpu", "--launch", "interleaved", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    mixed, split = result["rows"]
    assert (mixed["name"], split["name"]) == ("mixed_chunk8", "split_none_all_sms_interleaved")
    assert mixed["steps"] >= 2  # 8 prompt tokens under a budget of 8 - 2 decodes
    assert mixed["decode_tokens"] > 0 and split["decode_tokens"] > 0
    assert split["decode_steps"] > 1 and result["split_slots_returned"] is True
    assert result["verdict"]["go"] is None and "CUDA" in result["skipped"][0]
    assert {"device", "torch", "commit", "config"} <= result.keys()
    assert "verdict: undecided" in capsys.readouterr().out


def test_partition_failures_are_one_line_errors(spike):
    import torch
    partitions = sys.modules["spike_partitions"]
    with pytest.raises(partitions.PartitionUnavailable, match="need a CUDA device"):
        partitions.make_partition("torch", torch.device("cpu"), 16)
    if torch.cuda.is_available():
        pytest.skip("the API failures below are those of a host without CUDA")
    for make in (lambda: partitions._torch_partition(0, 16, 132), lambda: partitions._driver_partition(0, 16)):
        with pytest.raises(partitions.PartitionUnavailable) as info:
            make()
        assert "\n" not in str(info.value) and str(info.value)
