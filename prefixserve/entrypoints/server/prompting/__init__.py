"""From a request to what the renderer needs: request bodies parsed (bodies.py, in the render
process when large: render_pool.py), conversations built from them (conversations.py,
with prefixserve.prompt.tool_blocks), cache_control breakpoints as engine pins (pins.py) and the tokens of earlier
agent turns (turn_memory.py). Rendering itself is prefixserve.prompt, shared with diagnose."""
