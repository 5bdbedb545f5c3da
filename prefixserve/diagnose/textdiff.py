"""Text comparisons the rules share: canonical whitespace, changed values, changed lines."""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import lru_cache

_TRAILING_WS = re.compile(r"[ \t]+(?=\n)")
_INNER_SPACES = re.compile(r"(?<=\S)[ \t]{2,}(?=\S)")
_BLANK_RUNS = re.compile(r"\n{3,}")
_WORD = re.compile(r"\S+")
EDGE_PUNCT = ".,;:!?()[]{}<>\"'"

VALUE_KINDS: tuple[tuple[str, re.Pattern], ...] = (
    ("uuid", re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")),
    ("date", re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2})?)?Z?$|^\d{1,2}/\d{1,2}/\d{2,4}$")),
    ("time", re.compile(r"^\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?$")),
    ("hex id", re.compile(r"^(0x)?[0-9a-fA-F]{8,}$")),
    ("counter", re.compile(r"^#?\d+$")),
    ("name", re.compile(r"^[A-Z][a-z]+$")),
)
# Kinds recognised by their shape alone (a name is not: any capitalised word looks like one).
PATTERN_KINDS = frozenset({"uuid", "date", "time", "hex id", "counter"})


def normalize_whitespace(text: str) -> str:
    """The canonical whitespace of a text: LF line ends, no trailing blanks on a line, single
    spaces between words (indentation kept), at most one blank line in a row, no leading or
    trailing whitespace. Texts equal after this differ only in whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_WS.sub("", text)
    text = _INNER_SPACES.sub(" ", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip()


def without_whitespace(text: str) -> str:
    """The text with every whitespace character deleted: two texts that differ only in
    whitespace ("\\n" against "\\n\\n", CRLF, a double space, a trailing newline) give the same
    string. normalize_whitespace cannot serve as that test: it keeps a blank line apart from a
    line break, so a prompt alternating the two would look like two different texts."""
    return "".join(text.split())


def whitespace_only(a: str, b: str) -> bool:
    """a and b differ, and only in whitespace."""
    return a != b and without_whitespace(a) == without_whitespace(b)


@lru_cache(maxsize=8192)   # the fix simulation asks for every word of every system prompt
def value_kind(value: str) -> str:
    for kind, pattern in VALUE_KINDS:
        if pattern.match(value):
            return kind
    return "value"


@dataclass(frozen=True)
class ChangedValue:
    old: str         # as it appears in the earlier text ("" when inserted)
    new: str         # as it appears in the later text ("" when deleted)
    new_start: int   # character offset in the later text
    kind: str        # kinds of its words, e.g. "date+time"


def changed_values(old: str, new: str) -> list[ChangedValue]:
    """The words that differ between two texts, each widened to its whole whitespace-delimited
    word (without edge punctuation), adjacent changed words merged."""
    return list(_changed_values(old, new))


# dynamic-system and volatile-prefix both diff the same pair of system prompts, and a word
# diff of a long prompt costs milliseconds.
@lru_cache(maxsize=64)
def _changed_values(old: str, new: str) -> tuple[ChangedValue, ...]:
    old_words = [(m.start(), m.group()) for m in _WORD.finditer(old)]
    new_words = [(m.start(), m.group()) for m in _WORD.finditer(new)]
    matcher = difflib.SequenceMatcher(a=[w for _, w in old_words], b=[w for _, w in new_words],
                                      autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        old_text = " ".join(w.strip(EDGE_PUNCT) for _, w in old_words[i1:i2])
        new_text = " ".join(w.strip(EDGE_PUNCT) for _, w in new_words[j1:j2])
        start = new_words[j1][0] if j1 < len(new_words) else len(new)
        if j1 < j2:
            start += len(new_words[j1][1]) - len(new_words[j1][1].lstrip(EDGE_PUNCT))
        kind = "+".join(dict.fromkeys(value_kind(w) for w in (new_text or old_text).split()))
        out.append(ChangedValue(old_text, new_text, start, kind))
    return tuple(out)


@dataclass(frozen=True)
class LineDiff:
    changed_new: list[str]       # lines of the later text in changed regions
    changed_old: list[str]
    first_change_line: int       # index in the later text's lines
    stable_after: str            # equal text after the first changed region (joined lines)


def line_diff(old: str, new: str) -> LineDiff:
    old_lines, new_lines = old.split("\n"), new.split("\n")
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    changed_new: list[str] = []
    changed_old: list[str] = []
    first = -1
    stable_after: list[str] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            if first >= 0:
                stable_after.extend(new_lines[j1:j2])
            continue
        if first < 0:
            first = j1
        changed_new.extend(new_lines[j1:j2])
        changed_old.extend(old_lines[i1:i2])
    return LineDiff(changed_new, changed_old, first, "\n".join(line for line in stable_after if line.strip()))


def restore_leading_changes(old: str, new: str) -> str:
    """new with every changed region that stable (unchanged, non-blank) lines follow put back
    to old's lines; a changed region at the end (the per-request question) stays new's."""
    old_lines, new_lines = old.split("\n"), new.split("\n")
    ops = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False).get_opcodes()
    stable_later = [False] * len(ops)
    seen = False
    for k in range(len(ops) - 1, -1, -1):
        stable_later[k] = seen
        tag, _, _, j1, j2 = ops[k]
        seen = seen or (tag == "equal" and any(line.strip() for line in new_lines[j1:j2]))
    out: list[str] = []
    for (tag, i1, i2, j1, j2), later in zip(ops, stable_later):
        out.extend(old_lines[i1:i2] if tag != "equal" and later else new_lines[j1:j2])
    return "\n".join(out)


def restore_words(old: str, new: str) -> str:
    """new with every run of changed words put back to old's words, new's whitespace kept
    elsewhere. Its mirror, restore_words(new, old), is new with old's whitespace and new's
    words: the two undo one mistake each (a changed value, drifted whitespace) of a text that
    carries both, and applied one after the other in either order they give old."""
    a = [(m.start(), m.end()) for m in _WORD.finditer(old)]
    b = [(m.start(), m.end()) for m in _WORD.finditer(new)]
    ops = difflib.SequenceMatcher(a=[old[s:e] for s, e in a], b=[new[s:e] for s, e in b],
                                  autojunk=False).get_opcodes()
    out = new
    for tag, i1, i2, j1, j2 in reversed(ops):   # from the end: earlier offsets stay valid
        if tag == "equal":
            continue
        if j1 == j2:   # words only old has: inserted with the whitespace that follows them
            at = b[j1][0] if j1 < len(b) else len(new.rstrip())
            text = old[a[i1][0]:a[i2][0]] if i2 < len(a) else old[a[i1 - 1][1] if i1 else 0:a[i2 - 1][1]]
            out = out[:at] + text + out[at:]
        elif i1 == i2:   # words only new has: removed with the whitespace that follows them
            lo, hi = (b[j1][0], b[j2][0]) if j2 < len(b) else (b[j1 - 1][1] if j1 else 0, b[j2 - 1][1])
            out = out[:lo] + out[hi:]
        else:
            out = out[:b[j1][0]] + old[a[i1][0]:a[i2 - 1][1]] + out[b[j2 - 1][1]:]
    return out


def whitespace_drifts(old: str, new: str) -> bool:
    """Somewhere the two texts hold the same words with different whitespace between them,
    whatever else changed: whitespace drift sharing a part with another mistake."""
    return restore_words(new, old) != new
