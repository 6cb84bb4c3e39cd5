"""RPC methods declared by their type hints, and argument validation.

A service is any object whose coroutine methods are marked ``@rpc_method``::

    class Meta:
        @rpc_method
        async def lookup(self, parent: int, name: bytes) -> Attr: ...

The method's annotations *are* the wire schema: on every request the server
checks that exactly the declared arguments arrived with the declared types
(``int`` excludes ``bool``; ``list[T]``, ``dict[str, T]``, ``X | None``,
``Literal`` and ``TypedDict`` are checked recursively) and answers EINVAL
otherwise, so a handler never sees a wrongly typed value.

Two parameter names are special: ``payload`` receives the frame's raw bulk
bytes (``bytearray | None``) and ``ctx`` receives a `CallContext`.
A handler returns its result, or `Reply` to attach a raw payload.
"""

from __future__ import annotations

import errno
import inspect
import types
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import (
    Any,
    Literal,
    NotRequired,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

from shufflefs.rpc import framing
from shufflefs.rpc.errors import FsError

Validator = Callable[[Any, str], None]

PAYLOAD_PARAM = "payload"
CONTEXT_PARAM = "ctx"
MAX_DEPTH = 16


@dataclass
class CallContext:
    """What a handler may want to know about the call it serves."""

    peer: str
    method: str
    call_id: int


@dataclass
class Reply:
    """A result with a raw payload (a buffer or a list of buffers, sent with
    one ``sendmsg`` and never copied through msgpack)."""

    result: Any
    payload: bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview] | None = None


def encode_reply(call_id: int, result: Any, position: int | None = None) -> tuple[bytes, Any]:
    """A handler's result as a reply frame's body and payload."""
    if isinstance(result, Reply):
        return framing.reply_body(call_id, result.result, position), result.payload
    return framing.reply_body(call_id, result, position), None


@dataclass
class MethodSpec:
    name: str
    func: Callable[..., Awaitable[Any]]
    params: dict[str, Validator]
    required: frozenset[str]
    wants_payload: bool
    wants_ctx: bool
    defaults: dict[str, Any] = field(default_factory=dict)
    # Run in the connection's reader task, not a task of its own: for
    # handlers that never wait (a spawned task costs a trip through the
    # scheduler, which is most of a small call's latency).
    inline: bool = False
    # A synchronous try at the call, made inline: its result is the reply,
    # or None to run the (async) handler as usual.
    fast: Callable[..., Any] | None = None
    # A synchronous implementation that may block (on disk): what a thread
    # channel runs when `fast` did not answer (rpc/channel.py).
    threaded: Callable[..., Any] | None = None
    # `threaded` waits only for this machine's disks (no lock another call
    # holds, no peer): a channel with nothing else to do runs it on its own
    # thread instead of handing it to its pool (rpc/channel.py).
    disk_bound: bool = False

    def bind(self, args: Any, payload: bytearray | None, ctx: CallContext) -> dict[str, Any]:
        """Validate wire arguments and build the keyword arguments of the call."""
        if not isinstance(args, dict):
            raise FsError(errno.EINVAL, f"{self.name}: arguments must be a map")
        unknown = [k for k in args if k not in self.params]
        if unknown:
            raise FsError(
                errno.EINVAL, f"{self.name}: unexpected argument {str(unknown[0])[:64]!r}"
            )
        missing = self.required.difference(args)
        if missing:
            raise FsError(errno.EINVAL, f"{self.name}: missing argument {sorted(missing)[0]!r}")
        for key, value in args.items():
            self.params[key](value, f"{self.name}: argument {key!r}")
        kwargs = dict(args)
        if self.wants_payload:
            kwargs[PAYLOAD_PARAM] = payload
        elif payload:
            raise FsError(errno.EINVAL, f"{self.name}: takes no payload")
        if self.wants_ctx:
            kwargs[CONTEXT_PARAM] = ctx
        return kwargs


def rpc_method(
    func: Callable[..., Awaitable[Any]] | None = None,
    *,
    inline: bool = False,
    fast: str | None = None,
    threaded: str | None = None,
    disk_bound: bool = False,
) -> Any:
    """Mark a coroutine method as callable over RPC under its own name.

    ``@rpc_method(inline=True)``: the handler never waits for anything
    (pure computation, an LMDB read), so it runs in the connection's reader
    task. ``@rpc_method(fast="name")``: the service's synchronous method
    *name*, taking the same arguments, is tried inline first; it returns the
    result, or None when the real (async) handler must run.
    ``@rpc_method(threaded="name")``: the service's synchronous method
    *name*, taking the same arguments and free to block, serves the call on
    a thread channel (rpc/channel.py); without it the method is served on
    the event loop only. ``disk_bound=True`` (with *threaded*): that
    implementation waits for nothing but this machine's disks, so a channel
    with no other call under way may run it on its own thread."""

    def mark(f: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        if not inspect.iscoroutinefunction(f):
            raise TypeError(f"rpc method {f.__name__} must be async")
        f.__rpc_method__ = True  # type: ignore[attr-defined]
        f.__rpc_inline__ = inline  # type: ignore[attr-defined]
        f.__rpc_fast__ = fast  # type: ignore[attr-defined]
        f.__rpc_threaded__ = threaded  # type: ignore[attr-defined]
        f.__rpc_disk_bound__ = disk_bound  # type: ignore[attr-defined]
        return f

    return mark(func) if func is not None else mark


def collect_methods(*services: object) -> dict[str, MethodSpec]:
    """All ``@rpc_method`` methods of the given service objects, by name."""
    specs: dict[str, MethodSpec] = {}
    for service in services:
        for name, member in inspect.getmembers(service, inspect.ismethod):
            if not getattr(member, "__rpc_method__", False):
                continue
            if name in specs:
                raise ValueError(f"rpc method {name!r} defined twice")
            spec = _spec_for(name, member)
            spec.inline = getattr(member, "__rpc_inline__", False)
            fast_name = getattr(member, "__rpc_fast__", None)
            if fast_name is not None:
                spec.fast = getattr(service, fast_name)
            threaded_name = getattr(member, "__rpc_threaded__", None)
            if threaded_name is not None:
                spec.threaded = getattr(service, threaded_name)
                spec.disk_bound = getattr(member, "__rpc_disk_bound__", False)
            specs[name] = spec
    return specs


def _spec_for(name: str, method: Callable[..., Awaitable[Any]]) -> MethodSpec:
    hints = get_type_hints(method)
    sig = inspect.signature(method)
    params: dict[str, Validator] = {}
    required: set[str] = set()
    defaults: dict[str, Any] = {}
    wants_payload = wants_ctx = False
    for pname, param in sig.parameters.items():
        if pname == PAYLOAD_PARAM:
            wants_payload = True
            continue
        if pname == CONTEXT_PARAM:
            wants_ctx = True
            continue
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise TypeError(f"rpc method {name}: *args/**kwargs are not allowed")
        if pname not in hints:
            raise TypeError(f"rpc method {name}: parameter {pname} has no type hint")
        params[pname] = validator_for(hints[pname])
        if param.default is param.empty:
            required.add(pname)
        else:
            defaults[pname] = param.default
    return MethodSpec(name, method, params, frozenset(required), wants_payload, wants_ctx, defaults)


def _fail(where: str, expected: str, value: Any) -> FsError:
    return FsError(errno.EINVAL, f"{where}: expected {expected}, got {type(value).__name__}")


def _is_exactly(value: Any, tp: type) -> bool:
    return type(value) is tp


def validator_for(tp: Any, depth: int = 0) -> Validator:
    """Build a function that raises FsError(EINVAL) unless a value matches *tp*."""
    if depth > MAX_DEPTH:
        raise TypeError("type too deeply nested for an rpc schema")
    if tp is Any or tp is object:
        return lambda v, where: None
    if tp is None or tp is type(None):

        def check_none(v: Any, where: str) -> None:
            if v is not None:
                raise _fail(where, "nil", v)

        return check_none
    if tp is bool:

        def check_bool(v: Any, where: str) -> None:
            if not isinstance(v, bool):
                raise _fail(where, "bool", v)

        return check_bool
    if tp is int:

        def check_int(v: Any, where: str) -> None:
            if not isinstance(v, int) or isinstance(v, bool):
                raise _fail(where, "int", v)

        return check_int
    if tp is float:

        def check_float(v: Any, where: str) -> None:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise _fail(where, "float", v)

        return check_float
    if tp is str:

        def check_str(v: Any, where: str) -> None:
            if not isinstance(v, str):
                raise _fail(where, "str", v)

        return check_str
    if tp is bytes:

        def check_bytes(v: Any, where: str) -> None:
            if not isinstance(v, bytes):
                raise _fail(where, "bytes", v)

        return check_bytes
    if is_typeddict(tp):
        return _typeddict_validator(tp, depth)
    origin = get_origin(tp)
    args = get_args(tp)
    if origin in (Union, types.UnionType):
        alternatives = [validator_for(a, depth + 1) for a in args]
        names = " or ".join(getattr(a, "__name__", str(a)) for a in args)

        def check_union(v: Any, where: str) -> None:
            for alt in alternatives:
                try:
                    alt(v, where)
                    return
                except FsError:
                    continue
            raise _fail(where, names, v)

        return check_union
    if origin is Literal:
        allowed = set(args)
        allowed_types = {type(a) for a in args}

        def check_literal(v: Any, where: str) -> None:
            if type(v) not in allowed_types or v not in allowed:
                raise FsError(
                    errno.EINVAL, f"{where}: {v!r:.64} is not one of {sorted(map(str, allowed))}"
                )

        return check_literal
    if origin in (list, Sequence, typing.Sequence):
        item = validator_for(args[0] if args else Any, depth + 1)

        def check_list(v: Any, where: str) -> None:
            if not isinstance(v, list):
                raise _fail(where, "array", v)
            try:  # the path of each element is only spelled out for the message
                for x in v:
                    item(x, where)
            except FsError:
                for i, x in enumerate(v):
                    item(x, f"{where}[{i}]")
                raise

        return check_list
    if origin is tuple:
        items = [validator_for(a, depth + 1) for a in args]
        # a record of plain ints, bytes and strs (a read item): one type test
        # per element; anything else takes the full check (and its message)
        plain = tuple(args) if all(a in (int, bytes, str) for a in args) else None

        def check_tuple(v: Any, where: str) -> None:
            if not isinstance(v, list) or len(v) != len(items):
                raise _fail(where, f"array of {len(items)}", v)
            if plain is not None and all(map(_is_exactly, v, plain)):
                return
            try:  # as in check_list: the element's path only for the message
                for check, x in zip(items, v, strict=True):
                    check(x, where)
            except FsError:
                for i, (check, x) in enumerate(zip(items, v, strict=True)):
                    check(x, f"{where}[{i}]")
                raise

        return check_tuple
    if origin is dict:
        kcheck = validator_for(args[0] if args else Any, depth + 1)
        vcheck = validator_for(args[1] if args else Any, depth + 1)

        def check_dict(v: Any, where: str) -> None:
            if not isinstance(v, dict):
                raise _fail(where, "map", v)
            for k, x in v.items():
                kcheck(k, f"{where} key")
                vcheck(x, f"{where}[{str(k)[:32]!r}]")

        return check_dict
    raise TypeError(f"unsupported type in rpc schema: {tp!r}")


def _typeddict_validator(tp: Any, depth: int) -> Validator:
    hints = get_type_hints(tp, include_extras=True)
    # `__required_keys__` misses a ``NotRequired`` field whose annotation is
    # a string (``from __future__ import annotations``, Python < 3.12)
    optional = {k for k, t in hints.items() if get_origin(t) is NotRequired}
    fields = {
        k: validator_for(get_args(t)[0] if k in optional else t, depth + 1)
        for k, t in hints.items()
    }
    required = frozenset(getattr(tp, "__required_keys__", hints.keys())) - optional

    def check_record(v: Any, where: str) -> None:
        if not isinstance(v, dict):
            raise _fail(where, tp.__name__, v)
        missing = required.difference(v)
        if missing:
            raise FsError(errno.EINVAL, f"{where}: missing field {sorted(missing)[0]!r}")
        for k, x in v.items():
            check = fields.get(k)
            if check is None:
                raise FsError(errno.EINVAL, f"{where}: unexpected field {str(k)[:64]!r}")
            check(x, f"{where}.{k}")

    return check_record
