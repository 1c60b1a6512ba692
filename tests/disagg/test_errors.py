"""The cluster's typed errors: each pickles with its fields (Ray ships errors between processes),
keeps its builtin base (generic handlers still catch it) and stays a `ClusterError`."""

from __future__ import annotations

import pickle

import pytest

from disagg.errors import (ClusterError, DisaggError, InstanceDied, NoLiveInstance, QueueFull, RequestRefused,
                           RequestTimedOut, SignalTimeout)

ERRORS = [
    (QueueFull("the router's queue is full"), {}, RuntimeError),
    (NoLiveInstance("no live decode instance", role="decode"), {"role": "decode"}, RuntimeError),
    (InstanceDied("decode-0 died", instance="decode-0", reason="exit"), {"instance": "decode-0", "reason": "exit"},
     RuntimeError),
    (RequestRefused("prefill-0.add failed: prompt_token_ids: bad", instance="prefill-0",
                    argument="prompt_token_ids"), {"instance": "prefill-0", "argument": "prompt_token_ids"},
     ValueError),
    (RequestTimedOut("timed out after 2 s", timeout_s=2.0, stage="decoding"), {"timeout_s": 2.0, "stage": "decoding"},
     TimeoutError),
]


@pytest.mark.parametrize("err, fields, builtin", ERRORS, ids=lambda x: type(x).__name__)
def test_cluster_errors_pickle_with_their_fields(err, fields, builtin):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.args == err.args
    assert {name: getattr(back, name) for name in fields} == fields
    assert isinstance(back, (ClusterError, DisaggError, builtin))


def test_lease_expiry_error_names_both_pes():
    back = pickle.loads(pickle.dumps(SignalTimeout("KV did not land", request_id="r1", src_pe=0, dst_pe=1)))
    assert (back.request_id, back.src_pe, back.dst_pe) == ("r1", 0, 1) and "PE 0 -> PE 1" in str(back)
