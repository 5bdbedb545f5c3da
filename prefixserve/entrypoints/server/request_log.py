"""`serve --request-log PATH`: every finished generation request as one JSON line, in the format
`prefixserve lint` and `prefixserve replay` read (diagnose/log_reader.py):

    {"request_id": "chatcmpl-...", "timestamp": 1718000000.5, "tenant": "3f9a...",
     "body": {... as the client sent it ...}, "response": {"choices": [...], "usage": {...}}}

The tenant is an HMAC of the tenant name under a salt drawn when the server starts: a reader
can group a log's requests by tenant without learning who they are, and no API key is ever
written. Requests without keys (one anonymous tenant) carry no tenant field.

A request only puts its record on a queue; one writer thread parses the body, writes the line
and rotates the file, so no request waits on the disk or on parsing a large body. When a line
would take the file past `max_bytes`, the file becomes PATH.1 (replacing the previous one) and a
new PATH starts; a single record larger than the bound is dropped with a warning, so neither
file ever exceeds it. Both files are created 0600: bodies are the clients' prompts.

An image part is never written as sent: neither its pixels, nor a data URL's bytes, nor a URL (which
may carry a signed token). Each becomes, in the body, a part recording what the cache keyed it by:

    {"type": "image", "prefixserve_image": {"hash": "<content hash, 32 hex>", "width": 448,
     "height": 336, "tokens": 192, "format": "PNG", "bytes": 1234, "sha256": "<of the encoded bytes>"}}

(width and height as decoded, tokens as the prompt counted them), which is what `prefixserve lint`
needs to key the picture's tokens and to tell another picture from the same one re-encoded.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 2**20
# the content-part types an image arrives in: chat's image_url, Messages' image, Responses' input_image
IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})


@dataclass(frozen=True)
class LoggedRequest:
    """What one finished request leaves for the writer: nothing here is parsed or encoded yet."""
    request_id: str
    timestamp: float
    tenant: Optional[str]
    raw_body: bytes
    chat: bool                          # choices carry a message (chat, Messages) or a text
    choices: list[tuple[str, Optional[str]]]   # (text, finish_reason) of every sample
    prompt_tokens: int
    completion_tokens: int
    images: tuple[dict[str, Any], ...] = ()   # logged_images: what replaces each image part, in order


class RequestLog:
    """The JSONL request log of one server, with its writer thread (started here)."""

    def __init__(self, path: Union[str, Path], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"request log max_bytes must be a positive integer, got {max_bytes!r}")
        self.path = Path(path)
        self.rotated = self.path.with_name(self.path.name + ".1")
        self.max_bytes = max_bytes
        self._salt = secrets.token_bytes(32)
        self._queue: queue.SimpleQueue[Optional[LoggedRequest]] = queue.SimpleQueue()
        self._fd = self._open()     # fails at start-up, not at the first request, on a bad path
        self._size = os.fstat(self._fd).st_size
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    def tenant_hash(self, tenant: Optional[str]) -> Optional[str]:
        if tenant is None:
            return None
        return hmac.new(self._salt, tenant.encode("utf-8"), hashlib.sha256).hexdigest()[:32]

    def add(self, entry: LoggedRequest) -> None:
        """Queues one record; never blocks."""
        self._queue.put(entry)

    def close(self) -> None:
        """Writes what is queued, then stops the writer."""
        self._queue.put(None)
        self._thread.join()
        os.close(self._fd)

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)    # an existing file keeps its mode otherwise
        return fd

    def _run(self) -> None:
        while (entry := self._queue.get()) is not None:
            try:
                self._write(self._line(entry))
            except (OSError, ValueError) as exc:
                logger.warning("request log: record of %s not written: %s", entry.request_id, exc)

    def _line(self, entry: LoggedRequest) -> bytes:
        if entry.chat:
            choices: list[dict[str, Any]] = [
                {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                for i, (text, reason) in enumerate(entry.choices)]
        else:
            choices = [{"index": i, "text": text, "finish_reason": reason}
                       for i, (text, reason) in enumerate(entry.choices)]
        record: dict[str, Any] = {"request_id": entry.request_id, "timestamp": round(entry.timestamp, 3)}
        tenant = self.tenant_hash(entry.tenant)
        if tenant is not None:
            record["tenant"] = tenant
        record["body"] = json.loads(entry.raw_body)
        _replace_images(record["body"], iter(entry.images))
        record["response"] = {"choices": choices, "usage": {
            "prompt_tokens": entry.prompt_tokens, "completion_tokens": entry.completion_tokens}}
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")

    def _write(self, line: bytes) -> None:
        if len(line) > self.max_bytes:
            raise ValueError(f"the record is {len(line)} bytes, more than the log's bound of {self.max_bytes}")
        if self._size + len(line) > self.max_bytes:
            os.close(self._fd)
            os.replace(self.path, self.rotated)
            self._fd = self._open()
            self._size = 0
        os.write(self._fd, line)
        self._size += len(line)


def logged_images(loaded: Sequence[Any], spans: Sequence[tuple[bytes, int, int]]) -> tuple[dict[str, Any], ...]:
    """What the log records of each image (media.LoadedImage, in part order) and its span in the prompt
    the engine ran (RequestOutput.image_spans, (content hash, first token, tokens), in the same order)."""
    return tuple({"hash": digest.hex(), "width": item.width, "height": item.height,
                  "tokens": length, "format": item.format, "bytes": item.encoded_bytes,
                  "sha256": item.encoded_sha256}
                 for item, (digest, _, length) in zip(loaded, sorted(spans, key=lambda s: s[1])))


def _replace_images(node: Any, images: Iterator[dict[str, Any]]) -> None:
    """Every image part under node, in document order (the order the server read them in), becomes
    the next of `images`; one with none left (a request refused before its images were read) keeps
    no trace of its picture either."""
    items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for value in items:
        if isinstance(value, list):
            for i, part in enumerate(value):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    value[i] = {"type": "image", "prefixserve_image": next(images, None)}
                else:
                    _replace_images(part, images)
        elif isinstance(value, dict):
            _replace_images(value, images)
