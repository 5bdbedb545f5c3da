"""`prefixserve serve`: the OpenAI-compatible HTTP server (plus Anthropic's Messages API)."""
from __future__ import annotations

import argparse
import logging

from prefixserve.engine.config import EngineConfig
from prefixserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from prefixserve.entrypoints.server.config import ServerConfig

DEFAULT_MAX_WAITING = ServerConfig.max_waiting


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description=__doc__)
    add_engine_args(p, default_model="random:qwen3-tiny")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="name clients pass as `model` (default: the --model string)")
    g.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests accepted but not yet running; beyond this the server answers "
                        "429 with Retry-After (default: %(default)s)")
    g.add_argument("--retry-after", dest="retry_after_s", type=int, default=1,
                   help="seconds a 429 tells the client to wait (default: %(default)s)")
    g.add_argument("--max-pinned-fraction", type=float, default=EngineConfig.max_pinned_fraction,
                   help="share of the KV pool that cache_control pins and cached contents may "
                        "hold, so pins cannot starve live requests (default: %(default)s)")
    g.add_argument("--cache-ttl-scale", type=float, default=ServerConfig.cache_ttl_scale,
                   help="multiplies every cache TTL (\"5m\" -> 300 s x scale); for tests and "
                        "experiments (default: %(default)s)")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixserve.engine.llm_engine import LLMEngine
    from prefixserve.entrypoints.server.app import build_app

    server_config = ServerConfig(host=args.host, port=args.port,
                                 served_model_name=args.served_model_name,
                                 max_waiting=args.max_waiting, retry_after_s=args.retry_after_s,
                                 cache_ttl_scale=args.cache_ttl_scale)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The server bounds the queue itself (and answers 429); the engine stays unbounded behind it.
    engine = LLMEngine(engine_config_from_args(args, max_waiting=None,
                                               max_pinned_fraction=args.max_pinned_fraction))
    app = build_app(engine, server_config)
    uvicorn.run(app, host=server_config.host, port=server_config.port, log_level=args.log_level)
    return 0
