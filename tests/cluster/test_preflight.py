"""The preflight checks and the step loop, without Ray: geometry, sizing, paths, engine thread
(and a subclass of it holding steps)."""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path

import pytest

from disagg.cluster.launch.preflight import check_same_model, size_cache, transfer_paths
from disagg.cluster.launch.step_loop import StepLoop
from disagg.config import Config
from disagg.engine import TokenOutput
from disagg.errors import OutOfPages, PreflightError, SignalTimeout

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-1p1d.yaml"


def info(**changes) -> dict:
    base = {"geometry": {"num_layers": 2, "num_kv_heads": 2, "page_size": 16, "head_dim": 16,
                         "kv_dtype": "torch.float32"},
            "page_bytes": 8192, "kv_budget_bytes": 8192 * 100, "model_name": "dummy:tiny",
            "max_position_embeddings": 4096}
    geometry = {k: changes.pop(k) for k in list(changes) if k in base["geometry"]}
    base["geometry"].update(geometry)
    base.update(changes)
    return base


def test_mismatched_geometry_names_both_instances_and_the_field():
    with pytest.raises(PreflightError, match=r"prefill-0 and decode-0 differ in geometry: num_kv_heads 2 vs 4"):
        check_same_model(["prefill-0", "decode-0"], [info(), info(num_kv_heads=4)])
    with pytest.raises(PreflightError, match=r"differ in model_name: 'dummy:tiny' vs 'other'"):
        check_same_model(["a", "b"], [info(), info(model_name="other")])
    check_same_model(["a", "b"], [info(), info()])


def test_pages_sized_from_the_tightest_instance():
    config = Config.from_yaml(TINY).override({"cache.num_pages": None})
    sizing = size_cache(config, ["a", "b"], [info(), info(kv_budget_bytes=8192 * 40 + 5)])
    assert (sizing.num_pages, sizing.max_model_len) == (40, 40 * 16)


def test_no_room_for_a_page_says_so():
    config = Config.from_yaml(TINY).override({"cache.num_pages": None})
    with pytest.raises(PreflightError, match=r"b: no memory left for KV pages.*one page is 8192 bytes"):
        size_cache(config, ["a", "b"], [info(), info(kv_budget_bytes=-5)])


def test_max_model_len_beyond_the_model_or_the_pages():
    config = Config.from_yaml(TINY).override({"model.max_model_len": 5000, "cache.num_pages": None})
    with pytest.raises(PreflightError, match=r"max_model_len \(5000 tokens\) exceeds the model's"):
        size_cache(config, ["a"], [info()])
    config = Config.from_yaml(TINY).override({"model.max_model_len": 2048, "cache.num_pages": None})
    with pytest.raises(PreflightError, match=r"does not fit in one instance's cache: 100 pages"):
        size_cache(config, ["a"], [info()])


def test_transfer_paths_choose_segment_puts_for_unreachable_pairs():
    reach = {0: {2: True, 3: False}, 1: {2: True, 3: True}}
    paths = transfer_paths([0, 1], [2, 3], reach, force_segment_puts=False)
    assert paths == {(0, 2): "load/store", (0, 3): "segment puts", (1, 2): "load/store", (1, 3): "load/store"}
    forced = transfer_paths([0], [2], {0: {2: True}}, force_segment_puts=True)
    assert forced == {(0, 2): "segment puts"}


def _ray_must_not_start(monkeypatch) -> None:
    """The launch fails if it reaches Ray (`connect`) at all: what is asserted is that it stops before."""
    from disagg.cluster.launch import bootstrap

    def connect(config):
        raise AssertionError("the launch connected to Ray before its checks of this host failed")
    monkeypatch.setattr(bootstrap, "connect", connect)


def test_a_missing_model_directory_fails_the_launch_before_ray_starts(tmp_path, monkeypatch):
    from disagg.cluster import Cluster

    _ray_must_not_start(monkeypatch)
    missing = tmp_path / "no-such-model"
    config = Config.from_yaml(TINY).override({"model.source": str(missing)})
    with pytest.raises(PreflightError, match=rf"model.source '{missing}': no such directory; expected an HF "
                                             r"model directory \(config.json \+ \*.safetensors\)"):
        Cluster.launch(config)
    with pytest.raises(PreflightError, match=r"model.source 'dummy:tinyy': unknown preset; expected one of "
                                             r".*dummy:tiny"):
        Cluster.launch(Config.from_yaml(TINY).override({"model.source": "dummy:tinyy"}))


def test_a_model_directory_without_config_or_weights_is_named_before_ray_starts(tmp_path, caplog):
    from disagg.cluster.launch.preflight import check_model_source

    folder = tmp_path / "model"
    folder.mkdir()
    config = Config.from_yaml(TINY).override({"model.source": str(folder)})
    with pytest.raises(PreflightError, match=rf"{folder}/config.json: no such file"):
        check_model_source(config)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, '
                                        '"num_attention_heads": 4, "num_hidden_layers": 2, '
                                        '"intermediate_size": 128, "vocab_size": 256}')
    with pytest.raises(PreflightError, match=rf"{folder} has no \*.safetensors files"):
        check_model_source(config)
    check_model_source(Config.from_yaml(TINY))  # dummy:tiny
    joined = config.override({"model.source": str(tmp_path / "on-the-nodes"), "cluster.address": "auto"})
    check_model_source(joined)  # the nodes of a joined cluster may hold it: said, not refused
    assert "on-the-nodes': no such directory on this host" in caplog.text


def test_cuda_on_a_host_without_gpus_says_what_runs_on_the_cpu_before_ray_starts(monkeypatch):
    from disagg.cluster import Cluster

    from disagg.cluster.launch import bootstrap
    _ray_must_not_start(monkeypatch)
    monkeypatch.setattr(bootstrap, "count_local_gpus", lambda: 0)
    config = Config.from_yaml(TINY.parent / "llama3-8b-1p1d.yaml")
    with pytest.raises(PreflightError) as caught:
        Cluster.launch(config)
    message = str(caught.value)
    assert message.startswith("instances.device is cuda: 2 instances need 2 GPUs, this host")
    assert "configs/tiny-1p1d.yaml" in message and "--set instances.device=cpu --set transfer.backend=auto" in message
    joined = config.override({"cluster.address": "auto"})  # the cluster's GPUs are counted once joined
    with pytest.raises(AssertionError, match="connected to Ray"):
        Cluster.launch(joined)


def test_project_errors_cross_processes_with_their_fields():
    err = pickle.loads(pickle.dumps(OutOfPages("full", num_needed=7, num_free=2)))
    assert isinstance(err, OutOfPages) and (err.num_needed, err.num_free, str(err)) == (7, 2, "full")
    err = pickle.loads(pickle.dumps(SignalTimeout("late", request_id="r", src_pe=0, dst_pe=1)))
    assert isinstance(err, TimeoutError) and (err.request_id, err.dst_pe) == ("r", 1)


class ScriptedEngine:
    """Emits one token per step for each added request until it has ``n`` of them."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.todo: dict[str, int] = {}
        self.steps, self.fail_at_step = 0, fail_at_step
        self.thread_ids: set[int] = set()

    def add(self, rid: str, n: int) -> None:
        self.thread_ids.add(threading.get_ident())
        self.todo[rid] = n

    def has_work(self) -> bool:
        return bool(self.todo)

    def step(self) -> list[TokenOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("boom")
        out = []
        for rid in list(self.todo):
            self.todo[rid] -= 1
            done = self.todo[rid] == 0
            out.append(TokenOutput(rid, self.steps, done, "length" if done else None))
            if done:
                del self.todo[rid]
        return out


def test_step_loop_runs_calls_and_steps_on_one_thread_and_batches_outputs():
    woken = threading.Event()
    loop = StepLoop("t", on_output=woken.set)
    engine = ScriptedEngine()
    loop.call(setattr, loop, "engine", engine).result(5)
    loop.call(engine.add, "a", 3).result(5)
    loop.call(engine.add, "b", 1).result(5)
    assert woken.wait(5)
    rows = []
    deadline = time.monotonic() + 5
    while sum(r[2] for r in rows) < 2 and time.monotonic() < deadline:
        rows += loop.drain()[0]
        time.sleep(0.01)
    assert sorted((r[0], r[2], r[3]) for r in rows if r[2]) == [("a", True, "length"), ("b", True, "length")]
    assert [r[0] for r in rows].count("a") == 3
    assert all(len(r) == 6 and r[4] is None for r in rows)
    assert engine.thread_ids == {loop._thread.ident}
    loop.stop()


def test_step_loop_marks_a_failed_engine_fatal():
    loop = StepLoop("t")
    engine = ScriptedEngine(fail_at_step=1)
    loop.call(setattr, loop, "engine", engine).result(5)
    loop.call(engine.add, "a", 3).result(5)
    deadline = time.monotonic() + 5
    while loop.fatal is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.fatal is not None and "RuntimeError: boom" in loop.fatal
    loop.stop()


def test_a_step_loop_subclass_holds_steps_while_calls_run():
    """`_has_work` is where a subclass holds steps: the tests' `PausableStepLoop` (hooked_actor)."""
    from hooked_actor import PausableStepLoop

    loop = PausableStepLoop("t")
    engine = ScriptedEngine()
    loop.call(setattr, loop, "engine", engine).result(5)
    loop.call(loop.pause_steps, 1).result(5)
    loop.call(engine.add, "a", 3).result(5)
    _wait_until(lambda: loop.num_steps == 1)
    time.sleep(0.2)  # many idle waits: a loop that ignored the pause would have run both other steps
    assert loop.call(lambda: (loop.num_steps, engine.todo)).result(5) == (1, {"a": 2})  # calls still run
    loop.call(loop.resume_steps).result(5)
    _wait_until(lambda: not engine.todo)
    assert loop.num_steps == 3
    loop.stop()


def _wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_picker_least_loaded_and_round_robin():
    from disagg.cluster.launch.bootstrap import Instance
    from disagg.cluster.outputs import RequestMetrics
    from disagg.cluster.routing.requests import Picker, RoutedRequest

    p0, p1 = Instance("prefill-0", "prefill", None), Instance("prefill-1", "prefill", None)
    d0, d1 = Instance("decode-0", "decode", None), Instance("decode-1", "decode", None)
    busy = RoutedRequest("a", [1] * 50, None, None, RequestMetrics(0.0), stage="prefilling", prefill=p0, decode=d1)
    decoding = RoutedRequest("b", [1] * 10, None, None, RequestMetrics(0.0), stage="decoding", prefill=p1, decode=d0,
                             num_output=5)
    live = [busy, decoding]
    picker = Picker("least_loaded")
    assert picker.loads([p0, p1, d0, d1], live) == {"prefill-0": 50, "prefill-1": 0, "decode-0": 15, "decode-1": 50}
    assert [i.name for i in picker.order([p0, p1], live)] == ["prefill-1", "prefill-0"]
    assert [i.name for i in picker.order([d0, d1], live)] == ["decode-0", "decode-1"]
    p1.alive = False
    assert [i.name for i in picker.order([p0, p1], live)] == ["prefill-0"]
    rr = Picker("round_robin")
    assert [rr.order([d0, d1], live)[0].name for _ in range(3)] == ["decode-0", "decode-1", "decode-0"]
