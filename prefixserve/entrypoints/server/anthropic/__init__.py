"""The Anthropic-compatible Messages endpoint and its request body."""
