"""From a request to the prompt the engine sees: conversations from request bodies
(conversations.py), rendering with a cached content first (prompts.py), cache_control
breakpoints as engine pins (pins.py), and named cached contents (cached_contents.py).
Rendering itself is prefixserve.prompt, shared with diagnose."""
