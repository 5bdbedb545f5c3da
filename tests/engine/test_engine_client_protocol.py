"""Every call of EngineClient (prefixserve/engine/client.py) is served by each of the four classes
that serve clients, in its role, with the protocol's parameters: a call added to the protocol
and forgotten in one class, or whose parameters drifted in one, fails here.

Roles (client.py says why): AsyncLLM and ReplicatedLLM are fronts (every call, exactly, async
where the protocol is); LLMEngine is the engine (every call but FRONT_ONLY, synchronous, extra
keyword-only parameters with defaults allowed); EngineReplica is remote (each call the replica
front sends through the Ray Serve handle, as a coroutine; a prompt arrives as token_ids and a
trailing target_replica may be taken).
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Optional

import pytest

from prefixserve.engine import AsyncLLM, EngineClient, LLMEngine
from prefixserve.engine.client import FRONT_ONLY
from prefixserve.replicas.deployment import EngineReplica
from prefixserve.replicas.front import ReplicatedLLM

REPLICAS = Path(__file__).resolve().parents[2] / "prefixserve" / "replicas"
# What a front offers beyond the protocol, for its own users (tests, tools, /metrics of the replicas).
FRONT_EXTRAS = {"AsyncLLM": {"run_in_engine", "submit"},
                "ReplicatedLLM": {"replica_stats", "routing", "last_routing"}}


def calls() -> dict[str, object]:
    return {name: member for name, member in vars(EngineClient).items() if not name.startswith("_")}


def kind(member: object) -> str:
    if isinstance(member, property):
        return "attribute"
    if inspect.isasyncgenfunction(member):
        return "stream"
    if inspect.iscoroutinefunction(member):
        return "coroutine"
    return "method"


def protocol_kind(member: object) -> str:
    # The protocol declares a stream as a def returning an async iterator (an async generator
    # function implements it).
    if kind(member) == "method" and str(inspect.signature(member).return_annotation).startswith("AsyncIterator"):
        return "stream"
    return kind(member)


def member_of(cls: type, name: str) -> Optional[object]:
    """The class's member, or "attribute" for a data member it declares (`info: EngineInfo`)."""
    for klass in cls.__mro__[:-1]:
        if name in vars(klass):
            return vars(klass)[name]
        if name in vars(klass).get("__annotations__", {}):
            return property(lambda self: None)
    return None


def params(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()][1:]


def check_front(cls: type) -> list[str]:
    bad = []
    for name, spec in calls().items():
        impl = member_of(cls, name)
        if impl is None:
            bad.append(f"{cls.__name__} lacks {name}")
        elif kind(impl) != protocol_kind(spec):
            bad.append(f"{cls.__name__}.{name} is a {kind(impl)}, the protocol's a {protocol_kind(spec)}")
        elif kind(impl) != "attribute" and params(impl) != params(spec):
            bad.append(f"{cls.__name__}.{name}{inspect.signature(impl)} is not {inspect.signature(spec)}")
    extras = {name for name, m in vars(cls).items() if not name.startswith("_") and callable(m)}
    bad += [f"{cls.__name__}.{name} is not in the protocol" for name in
            sorted(extras - set(calls()) - FRONT_EXTRAS.get(cls.__name__, set()))]
    return bad


def accepts(impl: list, spec: list) -> bool:
    """impl takes every call spec allows, the same way: spec's positional parameters in order and
    its keyword-only ones, each of the same kind and default (a default where spec has none is
    fine), and beyond them only keyword-only parameters with defaults."""
    def same(param, s_param) -> bool:
        (name, k, default), (s_name, s_kind, s_default) = param, s_param
        return name == s_name and k == s_kind and (s_default is inspect.Parameter.empty or default == s_default)

    keyword_only = inspect.Parameter.KEYWORD_ONLY
    positional = [p for p in impl if p[1] is not keyword_only]
    s_positional = [p for p in spec if p[1] is not keyword_only]
    if len(positional) != len(s_positional) or not all(map(same, positional, s_positional)):
        return False
    keywords = {p[0]: p for p in impl if p[1] is keyword_only}
    for s_param in spec[len(s_positional):]:
        if s_param[0] not in keywords or not same(keywords.pop(s_param[0]), s_param):
            return False
    return all(default is not inspect.Parameter.empty for _, _, default in keywords.values())


def check_engine(cls: type) -> list[str]:
    bad = []
    for name, spec in calls().items():
        if name in FRONT_ONLY:
            continue
        impl = member_of(cls, name)
        if impl is None:
            bad.append(f"{cls.__name__} lacks {name}")
        elif (kind(impl) == "attribute") != (kind(spec) == "attribute") or kind(impl) in ("stream", "coroutine"):
            bad.append(f"{cls.__name__}.{name} is a {kind(impl)}: the engine serves a {kind(spec)} synchronously")
        elif kind(impl) != "attribute" and not accepts(params(impl), params(spec)):
            bad.append(f"{cls.__name__}.{name}{inspect.signature(impl)} does not take {inspect.signature(spec)}")
    return bad


def handle_calls() -> set[str]:
    """The replica methods the front and the service call through the Ray Serve handle:
    `handle.<name>.remote(...)` and `handle.options(method_name="<name>")`."""
    names = set()
    for module in ("front.py", "service.py"):
        for node in ast.walk(ast.parse((REPLICAS / module).read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "remote" and isinstance(node.value, ast.Attribute):
                owner = node.value.value
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if "handle" in owner_name:
                    names.add(node.value.attr)
            if isinstance(node, ast.keyword) and node.arg == "method_name" and isinstance(node.value, ast.Constant):
                names.add(node.value.value)
    return names


REMOTE_ONLY = {"target_replica", "images", "image_spans"}


def check_replica(cls: type, forwarded: set[str]) -> list[str]:
    bad = []
    for name in sorted(forwarded):
        impl = member_of(cls, name)
        if impl is None:
            bad.append(f"{cls.__name__} lacks {name}, which the replica front calls")
            continue
        if kind(impl) not in ("coroutine", "stream"):
            bad.append(f"{cls.__name__}.{name} is a {kind(impl)}: Ray Serve calls need coroutines")
        if name not in calls():
            continue
        remote = params(impl)
        # what only the replica front sends: the replica it targets, and a prompt's pictures as the
        # front decoded them with the spans it routed by (the protocol's prompt dict carries them
        # as multi_modal_data)
        while remote and remote[-1][0] in REMOTE_ONLY and remote[-1][2] in (None, ()):
            remote = remote[:-1]
        spec = [("token_ids" if p == "prompt" else p, k, d) for p, k, d in params(calls()[name])]
        if remote != spec:
            bad.append(f"{cls.__name__}.{name}{inspect.signature(impl)} is not the remote form of "
                       f"{inspect.signature(calls()[name])}")
    return bad


# ------------------------------------------------------------------ the four classes
@pytest.mark.parametrize("front", [AsyncLLM, ReplicatedLLM], ids=lambda c: c.__name__)
def test_each_front_serves_every_call(front: type) -> None:
    assert check_front(front) == []


def test_the_engine_serves_every_call_past_a_front_synchronously() -> None:
    assert check_engine(LLMEngine) == []


def test_the_replica_serves_every_call_the_replica_front_forwards() -> None:
    forwarded = handle_calls()
    assert {"generate", "reset_prefix_cache", "identify"} <= forwarded   # the scan finds them
    assert check_replica(EngineReplica, forwarded) == []


def test_the_protocol_declares_the_calls_clients_make() -> None:
    assert FRONT_ONLY <= set(calls())
    assert {"add_request", "generate", "abort", "stats", "info", "tokenizer", "max_model_len", "now",
            "start", "shutdown", "kv_snapshot", "kv_events", "reset_prefix_cache", "pin_prefix",
            "cached_contents", "delete_cached_content"} <= set(calls())


# ------------------------------------------------------------------ the checks catch drift
def without(cls: type, name: str) -> type:
    """cls as if `name` had been forgotten in it."""
    return type(cls.__name__, cls.__bases__, {k: v for k, v in vars(cls).items() if k != name})


@pytest.mark.parametrize("front,name", [(AsyncLLM, "pin_prefix"), (AsyncLLM, "is_running"),
                                        (ReplicatedLLM, "kv_events"), (ReplicatedLLM, "generate"),
                                        (ReplicatedLLM, "info")])
def test_a_call_forgotten_in_a_front_is_caught(front: type, name: str) -> None:
    if name == "info":   # a declared data member, not a method
        broken = type(front.__name__, (), {k: v for k, v in vars(front).items() if k != "__annotations__"})
        assert f"{front.__name__} lacks info" in check_front(broken)
    else:
        assert check_front(without(front, name)) == [f"{front.__name__} lacks {name}"]


def test_a_front_whose_call_drifted_is_caught() -> None:
    class Renamed(AsyncLLM):
        async def unpin(self, pin: str) -> bool: ...

    class Blocking(ReplicatedLLM):
        def list_pins(self): ...

    class Defaulted(AsyncLLM):
        async def find_cached_content(self, key, owner=None, param="key"): ...

    class Undeclared(AsyncLLM):
        def kv_stores_hold(self, block_hashes): ...

    assert any("unpin" in p for p in check_front(Renamed))
    assert any("list_pins" in p for p in check_front(Blocking))
    assert any("find_cached_content" in p for p in check_front(Defaulted))
    assert any("kv_stores_hold" in p for p in check_front(Undeclared))


def test_an_engine_call_forgotten_or_drifted_is_caught() -> None:
    assert check_engine(without(LLMEngine, "kv_events")) == ["LLMEngine lacks kv_events"]

    class Async(LLMEngine):
        async def list_pins(self): ...

    class Positional(LLMEngine):
        def unpin(self, pin_id, force): ...

    class NoDefault(LLMEngine):
        def cached_contents(self, owner): ...

    assert any("list_pins" in p for p in check_engine(Async))
    assert any("unpin" in p for p in check_engine(Positional))
    assert any("cached_contents" in p for p in check_engine(NoDefault))


def test_a_replica_call_forgotten_or_drifted_is_caught() -> None:
    forwarded = handle_calls()
    assert any("reset_prefix_cache" in p for p in check_replica(without(EngineReplica, "reset_prefix_cache"),
                                                                 forwarded))

    class Prompted(EngineReplica):
        async def generate(self, request_id, prompt, params, *, cache_salt=None, priority=0, cache_pins=()):
            yield None

    class Blocking(EngineReplica):
        def identify(self, target_replica=None): ...

    assert any("generate" in p for p in check_replica(Prompted, forwarded))
    assert any("identify" in p for p in check_replica(Blocking, forwarded))


def test_build_app_refuses_what_is_not_an_engine_client() -> None:
    from prefixserve.entrypoints.server.app import build_app

    class DuckFront:   # the calls the old duck-typed check looked for, and no more
        def add_request(self): ...
        def abort(self): ...
        def stats(self): ...
        def start(self): ...

    with pytest.raises(TypeError):
        build_app(DuckFront())
