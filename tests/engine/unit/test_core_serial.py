"""The msgpack codec between the front end and the engine core (engine/core/serial.py): every message round
trips exactly (SamplingParams re-validated, int-keyed dicts kept), nothing is pickled, and anything else is a
typed error."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import layerzero as lz
from layerzero.engine import EngineConfig, SamplingParams
from layerzero.engine.config import CudaGraphKnobs
from layerzero.engine.core import serial
from layerzero.engine.core.errors import MessageError
from layerzero.engine.core.messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from layerzero.engine.core.serial import (
    AbortRequests,
    CoreFailed,
    CoreReady,
    Shutdown,
    UtilityCall,
    UtilityResult,
    decode,
    encode,
)

pytestmark = pytest.mark.unit

ids = st.integers(0, 2**31 - 1)
f32 = st.floats(-1e6, 1e6, allow_nan=False, width=32)
params = st.builds(
    SamplingParams,
    n=st.integers(1, 8),
    temperature=st.floats(0, 10, allow_nan=False),
    top_k=st.integers(-1, 2**31 - 1),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0, 1),
    repetition_penalty=st.floats(0.01, 5),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    logit_bias=st.none() | st.dictionaries(ids, st.floats(-100, 100), max_size=5),
    stop=st.none() | st.text(min_size=1, max_size=6) | st.lists(st.text(min_size=1, max_size=6), max_size=3),
    stop_token_ids=st.none() | st.lists(ids, max_size=4),
    ignore_eos=st.booleans(),
    max_tokens=st.integers(8, 4096),
    min_tokens=st.integers(0, 8),
    seed=st.none() | st.integers(0, 2**63 - 1),
    logprobs=st.none() | st.integers(0, 20),
    skip_special_tokens=st.booleans(),
    prompt_logprobs=st.none() | st.integers(0, 20),
)
logprob_dicts = st.dictionaries(ids, f32, min_size=1, max_size=4)
outputs = st.builds(
    EngineCoreOutput,
    request_id=st.text(min_size=1, max_size=12),
    index=st.integers(0, 7),
    new_token_ids=st.lists(ids, max_size=4),
    new_logprobs=st.none() | st.lists(logprob_dicts, max_size=4),
    cumulative_logprob=f32,
    prompt_logprobs=st.none() | st.lists(st.none() | logprob_dicts, max_size=4),
    finish_reason=st.sampled_from([None, "stop", "length", "abort", "error"]),
    stop_reason=st.none() | ids | st.text(max_size=4),
    num_cached_tokens=st.integers(0, 10**6),
    error=st.none() | st.text(max_size=20),
)
stats = st.builds(
    SchedulerStats,
    *[st.integers(0, 10**9)] * 2,
    st.floats(0, 1),
    *[st.integers(0, 10**12)] * 5,
)


@settings(max_examples=150, deadline=None)
@given(
    params,
    st.lists(ids, min_size=1, max_size=50),
    st.integers(-(2**31), 2**31),
    st.floats(0, 2e9),
    st.none() | ids,
)
def test_request_round_trip(sp, prompt, priority, arrival, eos):
    req = EngineCoreRequest("req-1", prompt, sp, priority, arrival, eos)
    back = decode(encode(req))
    assert back == req and back.eos_token_id == eos
    assert back.sampling_params.stop_strings == sp.stop_strings
    if sp.logit_bias is not None:  # int keys survive (strict_map_key=False)
        assert all(type(k) is int for k in back.sampling_params.logit_bias)


@settings(max_examples=100, deadline=None)
@given(st.lists(outputs, max_size=8), st.floats(0, 2e9), st.none() | stats)
def test_outputs_round_trip(outs, ts, s):
    msg = EngineCoreOutputs(outs, ts, s)
    back = decode(encode(msg))
    assert back == msg
    for o in back.outputs:
        for d in o.new_logprobs or []:
            assert all(type(k) is int for k in d)


@pytest.mark.parametrize(
    "msg",
    [
        AbortRequests([EngineCoreAbort("a"), EngineCoreAbort("b", 1, "stop", "###")]),
        UtilityCall(3, "get_stats", []),
        UtilityCall(4, "kernel_report", [1, "x", {2: 3.5}]),
        UtilityResult(3, SchedulerStats(1, 2, 0.25, 3, 4, 5, 6, 7)),
        UtilityResult(4, {"op": {"bucket": ["k", 1.5]}, 5: None}),
        UtilityResult(5, None, "InvalidInputError", "bad"),
        Shutdown(),
        CoreReady({"max_model_len": 128, "num_kv_blocks": 9, "pid": 1}),
        CoreFailed("ConfigurationError", "max_model_len: expected ...", "startup", "Traceback ..."),
    ],
    ids=lambda m: type(m).__name__,
)
def test_control_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_params_travel_as_their_non_default_fields():
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    raw = msgpack.unpackb(encode(EngineCoreRequest("r", [1], sp)), strict_map_key=False)
    assert {"temperature": 0.0, "max_tokens": 5} in raw
    assert b"pickle" not in encode(EngineCoreRequest("r", [1], sp))


def test_decoded_params_are_validated_again():
    raw = msgpack.packb([serial.TAGS["EngineCoreRequest"], "r7", [1, 2], {"temperature": -1.0}, 0, 0.0])
    with pytest.raises(MessageError, match="temperature") as ei:
        decode(raw)
    assert ei.value.request_id == "r7"  # the core fails that request instead of dropping it
    raw = msgpack.packb([serial.TAGS["EngineCoreRequest"], "r8", [1], {"no_such_field": 1}, 0, 0.0])
    with pytest.raises(MessageError, match="no_such_field"):
        decode(raw)


@pytest.mark.parametrize(
    "data, match",
    [
        (msgpack.packb([99, 1, 2]), "tag: expected one of"),
        (msgpack.packb([]), r"array \[tag"),
        (msgpack.packb({"a": 1}), r"array \[tag"),
        (msgpack.packb([True]), r"array \[tag"),
        (msgpack.packb([serial.TAGS["UtilityCall"], 1]), "malformed fields"),
        (msgpack.packb([serial.TAGS["EngineCoreOutputs"], [[1, 2]], 0.0, None]), "malformed fields"),
        (b"\xc1", "expected msgpack bytes"),
        (pickle.dumps(Shutdown()), "msgpack"),
        (msgpack.packb([11, 1, msgpack.ExtType(42, b"x"), None, None]), "ext type"),
    ],
)
def test_bad_messages_are_typed_errors(data, match):
    with pytest.raises(MessageError, match=match):
        decode(data)


def test_encoding_refuses_what_is_not_a_message_or_plain_data():
    with pytest.raises(MessageError, match="expected one of"):
        encode(EngineCoreAbort("a"))  # aborts travel in an AbortRequests
    with pytest.raises(MessageError, match="plain data"):
        encode(UtilityResult(1, object()))
    with pytest.raises(MessageError, match="plain data"):
        encode(UtilityResult(1, {"t": torch.zeros(2)}))
    assert isinstance(MessageError("x"), ValueError) and isinstance(MessageError("x"), lz.LayerZeroError)


def test_numpy_scalars_travel_as_python_numbers():
    import numpy as np

    out = EngineCoreOutput("r", 0, [np.int64(5)], [{np.int32(5): np.float32(-0.5)}], np.float64(-0.5))
    back = decode(encode(EngineCoreOutputs([out], 1.0)))
    assert back.outputs[0].new_token_ids == [5] and back.outputs[0].new_logprobs == [{5: -0.5}]
    assert type(back.outputs[0].new_token_ids[0]) is int


def test_engine_config_round_trip():
    ec = EngineConfig(
        "/models/x",
        dtype=torch.bfloat16,
        device="cpu",
        max_model_len=64,
        num_kv_blocks=12,
        scheduling_policy="priority",
        quantization="int8",
        kv_cache_dtype="fp8",
        freeze_gc=False,
        cuda_graph=CudaGraphKnobs(lanes=1, narrow_tokens=None, piecewise_max_tokens=256),
    )
    assert serial.decode_config(serial.encode_config(ec)) == ec
    assert serial.decode_config(serial.encode_config(EngineConfig("m"))) == EngineConfig("m")


def test_engine_config_bytes_are_checked():
    raw = {f.name: ["plain", getattr(EngineConfig("m"), f.name)] for f in dataclasses.fields(EngineConfig)}
    raw["cuda_graph"] = ["config", {"lanes": ["plain", 1]}]
    raw["dtype"] = ["dtype", "not_a_dtype"]
    with pytest.raises(MessageError, match="dtype"):
        serial.decode_config(msgpack.packb(raw))
    raw["dtype"] = ["plain", None]
    raw["max_num_seqs"] = ["plain", 0]
    with pytest.raises(lz.ConfigurationError, match="max_num_seqs"):
        serial.decode_config(msgpack.packb(raw))
    with pytest.raises(MessageError):
        serial.decode_config(msgpack.packb([1, 2]))
