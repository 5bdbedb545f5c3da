"""changed-image: the text is the same but a picture is not, so the cache forks at the block holding the
picture's first token (each block a picture overlaps is keyed by its content hash). Names the picture's
part and tells a resized picture (another size is another picture to the cache) from a re-encoded one."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from prefixserve.diagnose.log_reader import LoggedImage, LogRecord
from prefixserve.diagnose.rules.base import Finding, Pair


def describe(image: LoggedImage) -> str:
    return f"{image.width}x{image.height} {image.format or 'image'}, {image.tokens} tokens, hash {image.content_hash}"


class ChangedImage:
    id = "changed-image"
    title = "A different picture behind the same text"
    fix = ("A picture's blocks are keyed by its content (the decoded pixels, their size and the processor "
           "settings), so only the very same picture is reused: send the picture the earlier request had, at "
           "the same size. The same picture in another lossless encoding (PNG, BMP, WebP lossless) hits; "
           "resized, cropped or re-encoded lossily (JPEG) it is another picture. Put a picture that changes "
           "after the stable text and pictures, not before them.")

    def check(self, pair: Pair) -> Optional[Finding]:
        cur, old = pair.current.image_at(pair.position), pair.earlier.image_at(pair.position)
        if cur is None and old is None:
            return None
        span = pair.current.span_at(pair.position)
        part = span.label if span else "prompt"
        if cur is None or old is None:
            placed = cur or old
            assert placed is not None
            detail = (f"a picture ({placed.image.where}) where the earlier request has text" if cur is not None
                      else f"text where the earlier request has a picture ({placed.image.where})")
            return Finding(self.id, pair.current.request_id, pair.earlier.request_id, pair.position,
                           part, detail, describe(old.image) if old else "text",
                           describe(cur.image) if cur else "text")
        a, b = old.image, cur.image
        if (a.width, a.height) != (b.width, b.height):
            why = (f"the picture is {b.width}x{b.height} here and {a.width}x{a.height} before: a picture at "
                   "another size has another content hash, so even the same picture resized is another picture "
                   "to the cache")
        elif a.sha256 is not None and a.sha256 == b.sha256:
            why = "the same encoded bytes with another content hash: the server's processor settings changed"
        elif a.format != b.format:
            why = (f"the same size, sent as {b.format} here and {a.format} before, and the decoded pixels differ: "
                   "another picture, or the same one re-encoded lossily")
        else:
            why = "the same size and encoding, other pixels: another picture"
        return Finding(self.id, pair.current.request_id, pair.earlier.request_id, pair.position, part,
                       f"the picture at {b.where} changed; {why}", describe(a), describe(b),
                       fix_data={"index": pair.current.images.index(cur), "earlier": a})

    def restore(self, finding: Finding, current: LogRecord,
                earlier: LogRecord) -> Optional[LogRecord]:
        if "index" not in finding.fix_data:
            return None   # a picture in the place of text, or the reverse: the text is other rules' part
        k, image = finding.fix_data["index"], finding.fix_data["earlier"]
        images = list(current.images)
        images[k] = replace(image, where=images[k].where)
        return replace(current, images=tuple(images))
