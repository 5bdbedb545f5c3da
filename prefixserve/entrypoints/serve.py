"""`prefixserve serve`: the OpenAI-compatible HTTP server (plus Anthropic's Messages API)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Optional

from prefixserve.engine.config import EngineConfig
from prefixserve.entrypoints.engine_args import add_engine_args, byte_size, engine_config_from_args, say_if_random
from prefixserve.entrypoints.server.auth import KeyTable
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.media import MediaConfig
from prefixserve.entrypoints.serve_replicas import add_replica_args, run_replicated, wants_replicas

DEFAULT_MAX_WAITING = ServerConfig.max_waiting
logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description=__doc__)
    add_engine_args(p, default_model="random:qwen3-tiny", positional_model=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=ServerConfig.host, help="address to listen on")
    g.add_argument("--port", type=int, default=ServerConfig.port, help="port to listen on")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id /v1/models lists and responses carry; requests may name it or "
                        "the model itself (default: the model as given)")
    g.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="sequences (each request its n) accepted and not finished; beyond this "
                        "the server answers 429 with Retry-After, so no more than this many can "
                        "ever wait, preempted ones included (default: %(default)s)")
    g.add_argument("--retry-after", dest="retry_after_s", type=int, default=1,
                   help="seconds a 429 or 503 tells the client to wait (default: %(default)s)")
    g.add_argument("--max-pinned-fraction", type=float, default=EngineConfig.max_pinned_fraction,
                   help="share of the KV pool that cache_control pins and cached contents may "
                        "hold, so pins cannot starve live requests (default: %(default)s)")
    g.add_argument("--max-pinned-fraction-per-tenant", type=float, default=None,
                   help="share of the KV pool one tenant's pins may hold, so no tenant can take all "
                        "of --max-pinned-fraction and have every other tenant's pins refused "
                        "(default: half of --max-pinned-fraction where --api-keys names two or "
                        "more tenants, else no share of its own)")
    g.add_argument("--max-cached-contents-per-tenant", type=int,
                   default=EngineConfig.max_cached_contents_per_tenant,
                   help="cached contents (/v1/cached_contents) one tenant may hold at once "
                        "(default: %(default)s)")
    g.add_argument("--cache-ttl-scale", type=float, default=ServerConfig.cache_ttl_scale,
                   help="multiplies every cache TTL (\"5m\" -> 300 s x scale); for tests and "
                        "experiments (default: %(default)s)")
    g.add_argument("--api-key", default=None,
                   help="one API key clients must send (Authorization: Bearer KEY or x-api-key); "
                        "its holder is the only tenant and the admin (default: no key asked for)")
    g.add_argument("--api-keys", type=Path, default=None, metavar="FILE",
                   help="JSON file of API keys, each naming its tenant: {\"KEY\": \"tenant\", "
                        "\"KEY2\": {\"tenant\": \"ops\", \"admin\": true}}; tenants never share "
                        "cached prefixes, cached contents or diagnoses; admin keys may reset the "
                        "cache and read /metrics; a tenant's key may ask for a priority up to its "
                        "\"max_priority\" (0 where it names none; admin keys: any) (default: none)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="run chat templates sent by clients (in the render process, under a time "
                        "and memory limit); refused by default")
    g.add_argument("--allow-unknown-fields", action="store_true",
                   help="accept request fields the server does not know (dropped, and logged once per "
                        "field name) instead of answering 400 naming them, for clients that send extras")
    g.add_argument("--max-body-bytes", type=byte_size, default=ServerConfig.max_body_bytes, metavar="SIZE",
                   help="largest request body accepted: bytes, or with a unit (64MiB) (default: %(default)s)")
    g.add_argument("--max-messages", type=int, default=ServerConfig.max_messages,
                   help="most messages in one chat request (default: %(default)s)")
    g.add_argument("--offload-body-bytes", type=byte_size, default=ServerConfig.offload_body_bytes,
                   metavar="SIZE",
                   help="bodies larger than this (bytes, or with a unit: 64KiB) are parsed and validated in "
                        "the render process, off the event loop (default: %(default)s)")
    g.add_argument("--request-log", default=None, metavar="PATH",
                   help="write every finished generation request (body, reply, hashed tenant) to this JSONL "
                        "file (mode 0600), the log `prefixserve lint` and `prefixserve replay` read")
    g.add_argument("--request-log-max-bytes", type=byte_size, default=ServerConfig.request_log_max_bytes,
                   metavar="SIZE", help="the request log moves to PATH.1 (replacing it) before it grows past "
                                        "this: bytes, or with a unit (64MiB) (default: %(default)s)")
    g.add_argument("--response-store", default=None, metavar="URL",
                   help="where /v1/responses keeps stored responses for previous_response_id: mem:// (this "
                        "process), file:///dir or redis://host:6379/0 (kept across restarts, shared by "
                        "replicas) (default: mem://)")
    g.add_argument("--response-store-ttl", type=float, default=ServerConfig.response_store_ttl_s,
                   metavar="SECONDS", help="a stored response expires this long after it was stored "
                                           "(default: %(default)s, 30 days)")
    g.add_argument("--response-store-max-responses", type=int,
                   default=ServerConfig.response_store_max_responses, metavar="N",
                   help="most stored responses per tenant; past it the tenant's oldest go (default: %(default)s)")
    g.add_argument("--response-store-max-bytes", type=byte_size, default=ServerConfig.response_store_max_bytes,
                   metavar="SIZE", help="most bytes of stored responses per tenant: bytes, or with a unit "
                                        "(256MiB); past it the tenant's oldest go (default: %(default)s)")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"), help="least severe log lines shown")
    m = p.add_argument_group("images")
    m.add_argument("--allowed-media-domains", default="", metavar="HOST,...",
                   help="hosts whose http(s) image URLs the server fetches (default: none; data: URLs and "
                        "base64 images are always taken)")
    m.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="folder whose files file: image URLs may name (default: none)")
    m.add_argument("--media-fetch-timeout", type=float, default=MediaConfig.fetch_timeout_s, metavar="SECONDS",
                   help="timeout of one image fetch (default: %(default)s)")
    m.add_argument("--max-image-bytes", type=byte_size, default=MediaConfig.max_image_bytes, metavar="SIZE",
                   help="encoded size of one image at most (default: 20MiB)")
    m.add_argument("--max-image-pixels", type=int, default=MediaConfig.max_image_pixels,
                   help="decoded pixels of one image at most, checked before decoding (default: %(default)s)")
    add_replica_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixserve.engine.llm_engine import LLMEngine
    from prefixserve.entrypoints.server.app import build_app

    server_config = server_config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.max_pinned_fraction_per_tenant = tenant_pin_share(args.max_pinned_fraction,
                                                           args.max_pinned_fraction_per_tenant, server_config.keys)
    # The server bounds the queue itself (and answers 429); the engine stays unbounded behind it.
    # Replicated, each replica bounds its own queue (429 from there) and the front holds none.
    weights = server_config.keys.weights if server_config.keys is not None else ()
    engine_config = engine_config_from_args(args, max_waiting=None, max_pinned_fraction=args.max_pinned_fraction,
                                            tenant_weights=weights)
    say_if_random(engine_config.model, "serving")
    if wants_replicas(args):
        return run_replicated(args, engine_config, server_config)
    engine = LLMEngine(engine_config)
    app = build_app(engine, server_config)
    uvicorn.run(app, host=server_config.host, port=server_config.port, log_level=args.log_level)
    return 0


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from serve's options (the engine's come from engine_config_from_args)."""
    if args.api_key is not None and args.api_keys is not None:
        raise ValueError("give --api-key or --api-keys, not both")
    keys = (KeyTable.single(args.api_key) if args.api_key is not None
            else KeyTable.from_file(args.api_keys) if args.api_keys is not None else None)
    return ServerConfig(host=args.host, port=args.port,
                        served_model_name=args.served_model_name,
                        max_waiting=args.max_waiting, retry_after_s=args.retry_after_s,
                        cache_ttl_scale=args.cache_ttl_scale, keys=keys,
                        trust_request_chat_template=args.trust_request_chat_template,
                        allow_unknown_fields=args.allow_unknown_fields,
                        max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
                        offload_body_bytes=args.offload_body_bytes,
                        request_log=args.request_log,
                        request_log_max_bytes=args.request_log_max_bytes,
                        response_store=args.response_store,
                        response_store_ttl_s=args.response_store_ttl,
                        response_store_max_responses=args.response_store_max_responses,
                        response_store_max_bytes=args.response_store_max_bytes,
                        media=MediaConfig(
                            allowed_domains=tuple(d for d in args.allowed_media_domains.split(",") if d),
                            allowed_local_path=args.allowed_local_media_path,
                            fetch_timeout_s=args.media_fetch_timeout, max_image_bytes=args.max_image_bytes,
                            max_image_pixels=args.max_image_pixels,
                            max_images=args.limit_mm_per_prompt.get("image")))


def tenant_pin_share(total: float, asked: Optional[float], keys: Optional[KeyTable]) -> Optional[float]:
    """The share of the pool one tenant's pins may hold: as asked, else half of all pins' share
    where the keys name several tenants (no one of them can then refuse the others' pins), else
    none of its own."""
    if asked is None and keys is not None and len(keys.tenants) > 1:
        asked = total / 2
    if asked is not None:
        logger.info("each tenant's pins may hold %.3g of the KV pool (all pins: %.3g)", asked, total)
    return asked
