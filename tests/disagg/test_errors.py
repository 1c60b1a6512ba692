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


@pytest.mark.parametrize("prompt, argument, kind", [
    ([3, 999], "prompt_token_ids", ValueError), ([], "prompt_token_ids", ValueError),
    ("text", "prompt_token_ids", TypeError)])
def test_engine_refusals_name_their_argument_as_a_field(prompt, argument, kind):
    """Engine input checks raise InvalidArgument (a ValueError; InvalidArgumentType also a
    TypeError) whose ``argument`` the router passes on without parsing the message."""
    from disagg.engine.request import check_new_request
    from disagg.errors import InvalidArgument
    from disagg.sampling import SamplingParams

    with pytest.raises(InvalidArgument) as err:
        check_new_request("r", prompt, SamplingParams(), known=set(), vocab_size=256, max_model_len=64)
    assert err.value.argument == argument and isinstance(err.value, kind)
    assert str(err.value).startswith(f"{argument}: ")
