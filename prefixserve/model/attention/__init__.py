"""Attention over the paged KV pool: per-step metadata and interchangeable backends."""
