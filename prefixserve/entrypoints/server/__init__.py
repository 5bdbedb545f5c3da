"""The HTTP server: OpenAI- and Anthropic-compatible APIs over one AsyncLLM.

Where to look:
    app.py          build_app: the routes, the engine's lifetime, /health, /metrics, reset
    config.py       ServerConfig
    state.py        what every endpoint shares (engine front, settings, the worker pool)
    errors.py       the one mapping from prefixserve.errors to HTTP statuses and error bodies
    openai/         /v1/chat/completions, /v1/completions and their request/response bodies
    anthropic/      /v1/messages and its request body
    prompting/      request bodies -> conversation -> rendered prompt, cache_control
                    breakpoints -> engine pins, and the named cached contents
    streaming.py    submitting to the engine, following outputs, server-sent events (both APIs)
    usage.py        token usage and prompt-cache accounting (both APIs)
    metrics.py      Prometheus metrics
    diagnosis.py    live cache-miss diagnosis in responses

The server talks to the engine only through prefixserve.engine's public API
(tests/test_engine_boundary.py checks every import).
"""
