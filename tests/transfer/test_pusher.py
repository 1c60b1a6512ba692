"""The KV pusher in one process (two shm PEs, one thread each) with hand-built plans.

The end-to-end tests through `PagedKVCache` and real processes are in `test_shm_processes.py`;
here each path and each misuse is pinned down exactly: what lands where, what is refused, and
that a refused call leaves both caches untouched.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from heap_threads import collective

from disagg.errors import ForwardStateError, TransferError
from disagg.plan import ForwardPlan
from disagg.transfer import DoorbellTable, KVPusher

LAYERS, PAGES, HEADS, PAGE, DIM = 3, 8, 2, 4, 8
# How the pusher reaches the receiver: KVPusher keyword arguments by path.
MODES = {"fused": {}, "caller-stream-append": {"append_on_caller_stream": True},
         "segment-puts": {"force_segment_puts": True},
         # the forward writes the local pages, then `push_written` pushes every layer at once
         "after-forward": {}, "after-forward-segment-puts": {"force_segment_puts": True}}
LAYERWISE = [mode for mode in MODES if not mode.startswith("after-forward")]
SHAPE = (LAYERS, PAGES, 2, HEADS, PAGE, DIM)
I32 = np.int32


def make_plan(seqs: list[dict], copies: tuple = ((), (), ()), forks: tuple = ((), ())) -> ForwardPlan:
    """A plan for the pusher: ``seqs`` entries ``{seq, slots, push_slots?, pe?, complete?}``."""
    lengths = [len(s["slots"]) for s in seqs]
    qo_indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(I32)
    push_slots = np.concatenate([s.get("push_slots", [-1] * n) for s, n in zip(seqs, lengths)]).astype(I32)
    push_pes = np.concatenate([[s["pe"] if s.get("push_slots") is not None else -1] * n
                               for s, n in zip(seqs, lengths)]).astype(I32)
    sends = [s for s in seqs if "pe" in s]
    return ForwardPlan(
        seq_ids=tuple(s["seq"] for s in seqs), qo_indptr=qo_indptr,
        page_indptr=np.zeros(len(seqs) + 1, I32), page_indices=np.zeros(0, I32),
        last_page_len=np.ones(len(seqs), I32),
        append_slots=np.concatenate([s["slots"] for s in seqs]).astype(I32),
        positions=np.concatenate([np.arange(n) for n in lengths]).astype(I32),
        push_slots=push_slots, push_pes=push_pes,
        copy_local_slots=np.asarray(copies[0], I32), copy_remote_slots=np.asarray(copies[1], I32),
        copy_pes=np.asarray(copies[2], I32),
        fork_src_slots=np.asarray(forks[0], I32), fork_dst_slots=np.asarray(forks[1], I32),
        send_seq_ids=np.array([s["seq"] for s in sends], np.int64),
        send_pes=np.array([s["pe"] for s in sends], I32),
        send_complete=np.array([s.get("complete", True) for s in sends], bool))


@pytest.fixture
def pair(heap_pair):
    """(sender heap, receiver heap, sender kv, receiver kv), both randomly filled."""
    h0, h1 = heap_pair
    kv0, kv1 = collective([lambda: h0.alloc(SHAPE, torch.float16), lambda: h1.alloc(SHAPE, torch.float16)])
    kv0.copy_(torch.randn(SHAPE).half())
    kv1.copy_(torch.randn(SHAPE).half())
    return h0, h1, kv0, kv1


def layer_kv(num_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(layer)
    x = torch.randn(2, num_tokens, HEADS, DIM, generator=gen).half()
    return x[0], x[1]


def written(kv: torch.Tensor, slots: np.ndarray, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[n, H, D]` at ``slots`` of ``layer``."""
    slots = torch.from_numpy(np.asarray(slots, dtype=np.int64))
    return kv[layer, slots // PAGE, 0, :, slots % PAGE], kv[layer, slots // PAGE, 1, :, slots % PAGE]


def run(pusher: KVPusher, plan: ForwardPlan, mode: str = "fused") -> None:
    if mode.startswith("after-forward"):  # as `ModelRunner` around a graph: forks, the forward, the push
        kv = pusher.kv
        fork_src = torch.from_numpy(plan.fork_src_slots.astype(np.int64))
        fork_dst = torch.from_numpy(plan.fork_dst_slots.astype(np.int64))
        kv[:, fork_dst // PAGE, :, :, fork_dst % PAGE] = kv[:, fork_src // PAGE, :, :, fork_src % PAGE]
        stored = plan.append_slots >= 0
        slots = torch.from_numpy(plan.append_slots[stored].astype(np.int64))
        for layer in range(LAYERS):
            k, v = layer_kv(plan.num_tokens, layer)
            kv[layer, slots // PAGE, 0, :, slots % PAGE] = k[torch.from_numpy(stored)]
            kv[layer, slots // PAGE, 1, :, slots % PAGE] = v[torch.from_numpy(stored)]
        pusher.push_written(plan)
        return
    pusher.begin_forward(plan)
    for layer in range(LAYERS):
        pusher.push_layer_async(layer, *layer_kv(plan.num_tokens, layer))
    pusher.end_forward()


@pytest.mark.parametrize("mode", list(MODES))
def test_push_lands_bit_exact_at_the_receiver_slots_only(pair, mode):
    h0, h1, kv0, kv1 = pair
    before0, before1 = kv0.clone(), kv1.clone()
    doorbells = DoorbellTable(h1)
    ticket = doorbells.arm(request_id=7)
    local, remote = np.array([9, 10, 11, 12, 13, 20]), np.array([0, 1, 2, 3, 4, 30])
    pusher = KVPusher(h0, kv0, **MODES[mode])
    pusher.attach_doorbell(7, ticket)
    run(pusher, make_plan([dict(seq=7, slots=local, push_slots=remote, pe=1)]), mode)
    assert doorbells.is_rung(ticket) and doorbells.poll() == [ticket]
    for layer in range(LAYERS):
        k, v = layer_kv(len(local), layer)
        for kv, slots in ((kv0, local), (kv1, remote)):
            got_k, got_v = written(kv, slots, layer)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
    for kv, before, slots in ((kv0, before0, local), (kv1, before1, remote)):
        touched = torch.zeros(LAYERS, PAGES * PAGE, dtype=torch.bool)
        touched[:, torch.from_numpy(slots)] = True
        untouched = ~touched.view(LAYERS, PAGES, 1, 1, PAGE, 1).expand(SHAPE)
        assert torch.equal(kv[untouched], before[untouched])


@pytest.mark.parametrize("mode", list(MODES))
def test_existing_kv_goes_page_to_page_and_forks_apply_first(pair, mode):
    h0, h1, kv0, kv1 = pair
    doorbells = DoorbellTable(h1)
    ticket = doorbells.arm(request_id=3)
    pusher = KVPusher(h0, kv0, **MODES[mode])
    pusher.attach_doorbell(3, ticket)
    existing_src, existing_dst = np.arange(4, 10), np.arange(16, 22)  # a page and a half
    fork_src, fork_dst = np.array([4, 5]), np.array([28, 29])
    fork_k, fork_v = written(kv0, fork_src, 1)
    plan = make_plan([dict(seq=3, slots=np.array([10, 11]), push_slots=np.array([22, 23]), pe=1)],
                     copies=(existing_src, existing_dst, [1] * 6), forks=(fork_src, fork_dst))
    expected = [written(kv0, existing_src, layer) for layer in range(LAYERS)]
    run(pusher, plan, mode)
    assert doorbells.is_rung(ticket)
    for layer in range(LAYERS):
        got_k, got_v = written(kv1, existing_dst, layer)
        assert torch.equal(got_k, expected[layer][0]) and torch.equal(got_v, expected[layer][1])
    k, v = written(kv0, fork_dst, 1)
    assert torch.equal(k, fork_k) and torch.equal(v, fork_v)


def test_two_sequences_in_one_batch_ring_only_when_complete(pair):
    h0, h1, kv0, kv1 = pair
    doorbells = DoorbellTable(h1)
    t_a, t_b = doorbells.arm("a"), doorbells.arm("b")
    pusher = KVPusher(h0, kv0)
    pusher.attach_doorbell(1, t_a)
    pusher.attach_doorbell(2, t_b)
    run(pusher, make_plan([dict(seq=1, slots=[0, 1], push_slots=[8, 9], pe=1, complete=True),
                           dict(seq=2, slots=[4, 5, 6], push_slots=[12, 13, 14], pe=1, complete=False)]))
    assert doorbells.is_rung(t_a) and not doorbells.is_rung(t_b)
    run(pusher, make_plan([dict(seq=2, slots=[7], push_slots=[15], pe=1, complete=True)]))
    assert doorbells.is_rung(t_b)
    assert doorbells.is_rung(t_a)  # still rung; release hands the word out again at a new epoch
    doorbells.release(t_a)


@pytest.mark.parametrize("mode", LAYERWISE)
def test_plan_without_transfers_is_a_local_append(pair, mode):
    h0, _, kv0, _ = pair
    pusher = KVPusher(h0, kv0, **MODES[mode])
    plan = make_plan([dict(seq=1, slots=np.array([3, 17]))])
    run(pusher, plan)
    k, v = layer_kv(2, 2)
    got_k, got_v = written(kv0, [3, 17], 2)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def _misuse_cases():
    ok = dict(seq=5, slots=[0, 1], push_slots=[4, 5], pe=1)
    return {
        "pe out of range": (make_plan([dict(ok, pe=3)]), TransferError, r"receiver PE must be in \[0, 2\).*got 3"),
        "pe is the sender": (make_plan([dict(ok, pe=0)]), TransferError, "not the sender, got 0"),
        "map and tokens disagree": (
            make_plan([dict(ok, push_slots=[4, -1])]), TransferError, "push map and tokens disagree at token 1"),
        "remote slot past the heap geometry": (
            make_plan([dict(ok, push_slots=[4, PAGES * PAGE])]), TransferError, "different geometries"),
        "local slot past the heap geometry": (
            make_plan([dict(ok, slots=[0, PAGES * PAGE + 3])]), ValueError, "different geometries"),
        "copy slot past the heap geometry": (
            make_plan([ok], copies=([0], [999], [1])), TransferError, "different geometries"),
        "push lengths differ from tokens": (
            dataclasses.replace(make_plan([ok]), push_slots=np.array([4], I32)), ValueError, "expected 2 entries"),
        "no doorbell for a completed send": (make_plan([dict(ok, seq=6)]), TransferError, "no doorbell ticket"),
    }


@pytest.mark.parametrize("entry", ["begin_forward", "push_written"])
@pytest.mark.parametrize("case", list(_misuse_cases()))
def test_misuse_raises_naming_request_and_pes_and_writes_nothing(pair, case, entry):
    h0, h1, kv0, kv1 = pair
    plan, error, match = _misuse_cases()[case]
    before0, before1 = kv0.clone(), kv1.clone()
    pusher = KVPusher(h0, kv0)
    pusher.attach_doorbell(5, DoorbellTable(h1).arm(5))
    with pytest.raises(error, match=match) as err:
        getattr(pusher, entry)(plan)
    if isinstance(err.value, TransferError):
        assert err.value.request_id in (5, 6) and err.value.src_pe == 0
        assert f"request {err.value.request_id}, PE 0 -> PE" in str(err.value)
    assert torch.equal(kv0, before0) and torch.equal(kv1, before1)
    run(pusher, make_plan([dict(seq=5, slots=[0, 1], push_slots=[4, 5], pe=1)]))  # still usable


def test_push_written_refuses_an_unstored_token_and_an_open_forward_writing_nothing(pair):
    h0, h1, kv0, kv1 = pair
    pusher = KVPusher(h0, kv0)
    doorbells = DoorbellTable(h1)
    ticket = doorbells.arm(5)
    pusher.attach_doorbell(5, ticket)
    before0, before1 = kv0.clone(), kv1.clone()
    unstored = make_plan([dict(seq=5, slots=[0, -1], push_slots=[4, 5], pe=1)])
    assert not pusher.can_push_written(unstored)
    with pytest.raises(TransferError, match=r"token 1 is pushed but has no local slot.*\(request 5, PE 0 -> PE 1\)"):
        pusher.push_written(unstored)
    plan = make_plan([dict(seq=5, slots=[0, 1], push_slots=[4, 5], pe=1)])
    pusher.begin_forward(plan)
    with pytest.raises(ForwardStateError, match="a forward is open"):
        pusher.push_written(plan)
    assert torch.equal(kv0, before0) and torch.equal(kv1, before1)
    assert not doorbells.is_rung(ticket)
    for layer in range(LAYERS):  # the refusals changed nothing: the open forward completes
        pusher.push_layer_async(layer, *layer_kv(2, layer))
    pusher.end_forward()
    assert torch.equal(written(kv1, [4, 5], 0)[0], layer_kv(2, 0)[0])


def test_doorbell_of_another_pe_and_closed_heap_are_refused(pair):
    h0, h1, kv0, _ = pair
    pusher = KVPusher(h0, kv0)
    ticket = DoorbellTable(h1).arm(5)
    with pytest.raises(TransferError, match=r"other than the sender \(request 5, PE 0 -> PE 0\)"):
        pusher.attach_doorbell(5, DoorbellTable(h0).arm(5))
    pusher.attach_doorbell(5, ticket)
    h0.close()
    with pytest.raises(TransferError, match=r"heap is closed \(request 5, PE 0 -> PE 1\)"):
        pusher.begin_forward(make_plan([dict(seq=5, slots=[0], push_slots=[4], pe=1)]))


def test_forward_order_is_enforced(pair):
    h0, h1, kv0, _ = pair
    pusher = KVPusher(h0, kv0)
    plan = make_plan([dict(seq=1, slots=[0, 1])])
    with pytest.raises(ForwardStateError):
        pusher.push_layer_async(0, *layer_kv(2, 0))
    pusher.begin_forward(plan)
    with pytest.raises(ForwardStateError):
        pusher.begin_forward(plan)
    pusher.push_layer_async(0, *layer_kv(2, 0))
    with pytest.raises(ForwardStateError, match="layer 0 was already pushed"):
        pusher.push_layer_async(0, *layer_kv(2, 0))
    with pytest.raises(ValueError, match=r"layer must be in \[0, 3\)"):
        pusher.push_layer_async(3, *layer_kv(2, 0))
    with pytest.raises(ForwardStateError, match=r"layers \[1, 2\] were not pushed"):
        pusher.end_forward()


@pytest.mark.parametrize("mode", LAYERWISE)
def test_bad_layer_input_raises_writes_nothing_and_the_layer_can_be_pushed_after(pair, mode):
    h0, h1, kv0, kv1 = pair
    pusher = KVPusher(h0, kv0, **MODES[mode])
    pusher.attach_doorbell(5, DoorbellTable(h1).arm(5))
    pusher.begin_forward(make_plan([dict(seq=5, slots=[0, 1], push_slots=[4, 5], pe=1)]))
    before0, before1 = kv0.clone(), kv1.clone()
    k, v = layer_kv(2, 0)
    bad = [((0, k[:1], v[:1]), ValueError, "k: expected 2 tokens"),
           ((0, k.float(), v.float()), TypeError, "k: expected the cache's dtype"),
           ((0, k, v[:, :1]), ValueError, "v: expected shape"),
           ((0, k, v), ValueError, "k_scale: scales apply"),
           ((-1, k, v), ValueError, r"layer must be in \[0, 3\), got -1"),
           ((0.0, k, v), TypeError, "layer: expected an int, got float")]
    for (layer, *kv), error, match in bad:
        kwargs = {"k_scale": 2.0} if match.startswith("k_scale") else {}
        with pytest.raises(error, match=match):
            pusher.push_layer_async(layer, *kv, **kwargs)
    assert torch.equal(kv0, before0) and torch.equal(kv1, before1)
    for layer in (np.int64(0), 1, 2):  # numpy ints are layers too
        pusher.push_layer_async(layer, *layer_kv(2, int(layer)))
    pusher.end_forward()
    got_k, _ = written(kv1, [4, 5], 0)
    assert torch.equal(got_k, k)


def test_kv_must_be_heap_memory_of_the_kv_layout(pair):
    h0, *_ = pair
    with pytest.raises(ValueError, match="not memory of this heap"):
        KVPusher(h0, torch.zeros(SHAPE, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[num_layers, num_pages, 2, H, P, D\]"):
        KVPusher(h0, torch.zeros(4, 4))


def test_detach_doorbell_forgets_the_ticket_of_an_aborted_request(pair):
    """An aborted request's ticket is handed back; a plan that would still complete its send is
    then refused before anything is written (the cache must drop the send first), and the
    request's word is never rung."""
    h0, h1, kv0, kv1 = pair
    doorbells = DoorbellTable(h1)
    ticket = doorbells.arm(7)
    pusher = KVPusher(h0, kv0)
    pusher.attach_doorbell(7, ticket)
    assert pusher.detach_doorbell(7) is ticket
    assert pusher.detach_doorbell(7) is None
    before = kv1.clone()
    with pytest.raises(TransferError, match="request 7"):
        pusher.begin_forward(make_plan([dict(seq=7, slots=[0], push_slots=[4], pe=1)]))
    assert torch.equal(kv1, before) and not doorbells.is_rung(ticket)
    run(pusher, make_plan([dict(seq=8, slots=[1])]))  # the pusher goes on with other requests
    assert not doorbells.is_rung(ticket)


def test_index_arrays_reach_the_device_16_byte_aligned_int64(pair):
    """Triton specializes `copy_slots` on its index pointers' dtype and 16-byte alignment: int32
    arrays packed end to end compiled it anew mid-run (the engine's warm-up compiles int64)."""
    h0, _, kv0, _ = pair
    pusher = KVPusher(h0, kv0)
    arrays = [np.arange(n, dtype=np.int32) for n in (3, 5, 1, 8)]
    tensors = pusher._to_device(*arrays)
    base = tensors[0].data_ptr()
    for a, t in zip(arrays, tensors):
        assert (t.data_ptr() - base) % 16 == 0 and t.dtype == torch.int64 and t.tolist() == a.tolist()
