"""The wire format between the front end and the engine core process: msgpack, never pickle.

Every message is one msgpack array ``[tag, field, ...]``: the tag names its type (:data:`TAGS`), the fields
follow in the dataclass's order. Dicts keep int keys (logprobs by token id, ``logit_bias``: decoded with
``strict_map_key=False``), floats travel as float64, tuples come back as lists.
:class:`~layerzero.engine.SamplingParams` travels as a dict of its init fields that differ from the defaults
and is decoded by calling ``SamplingParams(**fields)``, so its validation runs again in the receiving process.
The engine's options (:class:`~layerzero.engine.EngineConfig`) cross the same way at start-up
(:func:`encode_config`): the child process gets bytes, not objects.

Messages, front end -> core: :class:`EngineCoreRequest`, :class:`AbortRequests`, :class:`UtilityCall`,
:class:`Shutdown`; core -> front end: :class:`CoreReady` (the handshake), :class:`CoreFailed` (start-up or a
step failed: the core is gone), :class:`EngineCoreOutputs` (one per step), :class:`UtilityResult`.

>>> decode(encode(AbortRequests([EngineCoreAbort("r1")])))
AbortRequests(aborts=[EngineCoreAbort(request_id='r1', index=None, reason='abort', stop_reason=None)])
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import layerzero as lz

from ..sampling_params import SamplingParams, StructuredOutputsParams
from .errors import MessageError
from .messages import EngineCoreAbort, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats

__all__ = [
    "TAGS",
    "AbortRequests",
    "CoreFailed",
    "CoreReady",
    "Shutdown",
    "UtilityCall",
    "UtilityResult",
    "decode",
    "decode_config",
    "encode",
    "encode_config",
]


@dataclass
class AbortRequests:
    """Front end -> core: end these completions (:meth:`EngineCoreProtocol.abort_requests`)."""

    aborts: list[EngineCoreAbort]


@dataclass
class UtilityCall:
    """Front end -> core: call ``method`` (one of the core process's allow-list) with ``args`` (plain data);
    answered by a :class:`UtilityResult` with the same ``call_id``."""

    call_id: int
    method: str
    args: list[Any] = field(default_factory=list)


@dataclass
class UtilityResult:
    """Core -> front end: the ``value`` a :class:`UtilityCall` returned (plain data or a
    :class:`SchedulerStats`), or the error it raised (``error_type``: the class name, ``error``: the
    message)."""

    call_id: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None


@dataclass
class Shutdown:
    """Front end -> core: stop stepping, release the model and exit."""


@dataclass
class CoreReady:
    """Core -> front end, first message: the core is built; ``info`` holds ``max_model_len``,
    ``num_kv_blocks`` and ``pid``."""

    info: dict[str, Any]


@dataclass
class CoreFailed:
    """Core -> front end: the core could not start (``during="startup"``) or a step raised
    (``during="step"``); the process exits after sending it. ``error_type``: the exception's class name."""

    error_type: str
    message: str
    during: str = "startup"
    traceback: str = ""


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


_OUTPUT_FIELDS = operator.attrgetter(*_names(EngineCoreOutput))
_STATS_FIELDS = operator.attrgetter(*_names(SchedulerStats))
_ABORT_FIELDS = operator.attrgetter(*_names(EngineCoreAbort))
_PARAM_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init
}  # every init field has a plain default
_STATS_EXT = 1  # msgpack ext type code of a SchedulerStats inside a utility result


def params_fields(p: SamplingParams) -> dict[str, Any]:
    """The init fields of ``p`` that differ from the defaults (the validated values; read-only mappings as
    dicts): ``SamplingParams(**params_fields(p))`` rebuilds ``p``."""
    out = {}
    for name, default in _PARAM_DEFAULTS.items():
        v = getattr(p, name)
        if v != default:
            if isinstance(v, MappingProxyType):
                v = dict(v)
            elif isinstance(v, StructuredOutputsParams):
                v = v.to_dict()
            out[name] = v
    return out


def _default(obj: Any) -> Any:
    """msgpack's hook for what it does not pack itself: numpy scalars, read-only mappings, stats."""
    if isinstance(obj, SchedulerStats):
        return _msgpack().ExtType(_STATS_EXT, _pack(list(_STATS_FIELDS(obj))))
    if isinstance(obj, MappingProxyType):
        return dict(obj)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    raise MessageError(
        f"message field: expected plain data (None, bool, int, float, str, bytes, list, dict), got "
        f"{type(obj).__name__}"
    )


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _STATS_EXT:
        return SchedulerStats(*_unpack(data))
    raise MessageError(f"msgpack ext type: expected {_STATS_EXT} (SchedulerStats), got {code}")


_MSGPACK: Any = None


def _msgpack() -> Any:
    """msgpack, imported on first use (``import layerzero.engine`` does not import it)."""
    global _MSGPACK
    if _MSGPACK is None:
        import msgpack

        _MSGPACK = msgpack
    return _MSGPACK


def _pack(obj: Any) -> bytes:
    return _msgpack().packb(obj, use_bin_type=True, default=_default)


def _unpack(data: bytes) -> Any:
    return _msgpack().unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=_ext_hook)


# ---------------------------------------------------------------------------------------------- messages
_REQUEST_FIELDS = _names(EngineCoreRequest)
_PARAMS_AT = _REQUEST_FIELDS.index("sampling_params")


def _enc_request(m: EngineCoreRequest) -> list[Any]:
    f = [getattr(m, name) for name in _REQUEST_FIELDS]
    f[_PARAMS_AT] = params_fields(m.sampling_params)
    return f


def _dec_request(f: list[Any]) -> EngineCoreRequest:
    rid, params = f[0], f[_PARAMS_AT]
    if not isinstance(params, dict):
        raise MessageError(f"EngineCoreRequest.sampling_params: expected a dict, got {type(params).__name__}")
    try:
        f[_PARAMS_AT] = SamplingParams(**params)
    except (TypeError, lz.InvalidInputError) as exc:
        raise MessageError(f"EngineCoreRequest.sampling_params of {rid!r}: {exc}", request_id=rid) from exc
    return EngineCoreRequest(*f)


def _enc_outputs(m: EngineCoreOutputs) -> list[Any]:
    stats = None if m.stats is None else _STATS_FIELDS(m.stats)
    return [[_OUTPUT_FIELDS(o) for o in m.outputs], m.timestamp, stats]


def _dec_outputs(f: list[Any]) -> EngineCoreOutputs:
    outs, ts, stats = f
    return EngineCoreOutputs(
        [EngineCoreOutput(*o) for o in outs], ts, None if stats is None else SchedulerStats(*stats)
    )


_ENCODERS: dict[type, tuple[int, Any]] = {
    EngineCoreRequest: (1, _enc_request),
    AbortRequests: (2, lambda m: [[_ABORT_FIELDS(a) for a in m.aborts]]),
    UtilityCall: (3, lambda m: [m.call_id, m.method, m.args]),
    Shutdown: (4, lambda m: []),
    EngineCoreOutputs: (10, _enc_outputs),
    UtilityResult: (11, lambda m: [m.call_id, m.value, m.error_type, m.error]),
    CoreReady: (12, lambda m: [m.info]),
    CoreFailed: (13, lambda m: [m.error_type, m.message, m.during, m.traceback]),
}
_DECODERS: dict[int, Any] = {
    1: _dec_request,
    2: lambda f: AbortRequests([EngineCoreAbort(*a) for a in f[0]]),
    3: lambda f: UtilityCall(*f),
    4: lambda f: Shutdown(*f),
    10: _dec_outputs,
    11: lambda f: UtilityResult(*f),
    12: lambda f: CoreReady(*f),
    13: lambda f: CoreFailed(*f),
}
TAGS = {cls.__name__: tag for cls, (tag, _) in _ENCODERS.items()}
"""Message type name -> its tag on the wire."""


def encode(msg: Any) -> bytes:
    """``msg`` (one of the message types above) as msgpack bytes.

    Raises:
        MessageError: not a message type; a field that is not plain data.
    """
    enc = _ENCODERS.get(type(msg))
    if enc is None:
        raise MessageError(f"message: expected one of {sorted(TAGS)}, got {type(msg).__name__}")
    tag, fn = enc
    return _pack([tag, *fn(msg)])


def decode(data: bytes) -> Any:
    """The message encoded in ``data`` (:func:`encode`'s inverse).

    Raises:
        MessageError: not msgpack, not a ``[tag, ...]`` array, an unknown tag, fields of the wrong number or
            kind; SamplingParams that fail validation (``request_id`` set).
    """
    try:
        obj = _unpack(data)
    except MessageError:
        raise
    except Exception as exc:  # msgpack's errors: ExtraData, FormatError, StackError, ValueError, ...
        raise MessageError(f"message: expected msgpack bytes, got {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, list) or not obj or isinstance(obj[0], bool) or not isinstance(obj[0], int):
        raise MessageError(f"message: expected an array [tag, ...], got {repr(obj)[:80]}")
    dec = _DECODERS.get(obj[0])
    if dec is None:
        raise MessageError(f"message tag: expected one of {sorted(_DECODERS)}, got {obj[0]}")
    try:
        return dec(obj[1:])
    except MessageError:
        raise
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise MessageError(
            f"message with tag {obj[0]}: malformed fields ({type(exc).__name__}: {exc})"
        ) from exc


# ------------------------------------------------------------------------------------------ engine config
def encode_config(config: Any) -> bytes:
    """An :class:`~layerzero.engine.EngineConfig` as msgpack bytes: plain fields as they are, a
    ``torch.dtype`` by name, nested frozen configs (``cuda_graph``) as dicts of their fields."""
    import torch

    def value(v: Any) -> Any:
        if isinstance(v, torch.dtype):
            return ["dtype", str(v).removeprefix("torch.")]
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return ["config", {f.name: value(getattr(v, f.name)) for f in dataclasses.fields(v)}]
        return ["plain", v]

    return _pack({f.name: value(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init})


def decode_config(data: bytes) -> Any:
    """:func:`encode_config`'s inverse: the ``EngineConfig`` rebuilt (validated again).

    Raises:
        MessageError: bytes that are not an encoded config. ConfigurationError: a value it rejects.
    """
    import torch

    from ..config import EngineConfig

    nested = _nested_configs(EngineConfig)

    def value(name: str, kind_v: Any, cls: type | None) -> Any:
        kind, v = kind_v
        if kind == "dtype":
            dt = getattr(torch, v, None)
            if not isinstance(dt, torch.dtype):
                raise MessageError(f"EngineConfig.{name}: expected a torch dtype name, got {v!r}")
            return dt
        if kind == "config":
            if (
                cls is None
            ):  # an optional nested config (speculative_config): its fields, as EngineConfig takes
                if not isinstance(v, dict):
                    raise MessageError(f"EngineConfig.{name}: expected a dict of a nested config's fields")
                return {k: value(k, kv, None) for k, kv in v.items()}
            sub = _nested_configs(cls)
            return cls(**{k: value(k, kv, sub.get(k)) for k, kv in v.items()})
        return v

    try:
        fields = _unpack(data)
        return EngineConfig(**{k: value(k, kv, nested.get(k)) for k, kv in fields.items()})
    except (TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, (MessageError, lz.ConfigurationError)):
            raise
        raise MessageError(f"EngineConfig bytes: malformed ({type(exc).__name__}: {exc})") from exc


def _nested_configs(cls: type) -> dict[str, type | None]:
    """Each field's nested frozen-config class, read off its default or default factory (never called: a
    factory may read the environment), else None."""
    out: dict[str, type | None] = {}
    for f in dataclasses.fields(cls):
        kind = f.default_factory if f.default_factory is not dataclasses.MISSING else type(f.default)
        out[f.name] = kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None
    return out
