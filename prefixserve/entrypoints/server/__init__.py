"""The HTTP server: OpenAI- and Anthropic-compatible APIs over one AsyncLLM.

Where to look:
    app.py              build_app: mounts the routes, the engine's lifetime, /health, /metrics, reset
    config.py           ServerConfig
    pipeline.py         one generation request, whichever API: auth -> parse -> render -> submit
                        -> stream or collect -> usage
    openai/             the OpenAI dialect: /v1/chat/completions, /v1/completions, their bodies,
                        and vLLM's /tokenize, /detokenize
    anthropic/          the Anthropic dialect: /v1/messages, /v1/messages/count_tokens, their bodies
    responses/          OpenAI's Responses API: /v1/responses (create, retrieve, delete, input items)
    cached_contents.py  the /v1/cached_contents routes
    --- shared by the above; never importing a dialect (tests/entrypoints/server/test_server_layers.py)
    streaming.py        the one stream loop and server-sent events
    generation.py       submitting to the engine, following outputs, aborting on disconnect
    rendering.py        a request's conversation (after a cached content's) -> prompt tokens, pins
    prompting/          request bodies -> conversations, cache_control breakpoints -> engine pins,
                        the render process, the memory of agent turns
    protocol.py         what every request body shares (strict validation, diagnosis fields)
    tools.py            tools, tool_choice and response_format, in either API's shape
    usage.py            token usage and prompt-cache accounting
    prompt_cache_fields.py  OpenAI's prompt_cache_* fields -> marks, write limit, routing key
    diagnosis.py        live cache-miss diagnosis in responses
    state.py            what every endpoint shares (engine front, settings, the render process)
    response_store.py   stored responses per tenant (mem://, file://, redis://), bounded, expiring
    errors.py           the one mapping from prefixserve.errors to HTTP statuses and error bodies
    metrics.py          Prometheus metrics
    gate.py, auth.py    API keys, tenants and the body-size bound, before a body is parsed

The server talks to the engine only through prefixserve.engine's public API
(tests/entrypoints/test_engine_boundary.py checks every import).
"""
