"""The OpenAI-compatible endpoints: chat completions, completions, and their bodies."""
