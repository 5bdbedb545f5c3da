"""Trains prefixserve's built-in byte-level BPE tokenizer and writes prefixserve/tokenizer/data/tokenizer.json.

Usage (from the repository root):

    .venv/bin/python scripts/train_tokenizer.py            # writes the shipped files
    .venv/bin/python scripts/train_tokenizer.py --check    # retrains and fails if the result differs

Training text, all of it redistributable with the project:
  * scripts/tokenizer_corpus/*.txt: prose, chat-style questions and answers, JSON / tool-call
    snippets and code, written for this project;
  * the project's own README.md, docs/**/*.md and prefixserve/**/*.py.
Files are read in sorted order and the BPE trainer breaks ties between equally frequent pairs
deterministically, so the same inputs always give the same tokenizer. Because the project's source
keeps changing, data/training_manifest.json records the sha256 of every input file used for the
shipped tokenizer.json; --check compares against a retrain on the files as they are now.

Design of the tokenizer:
  * byte-level: every string maps to bytes first, so any unicode text round-trips exactly;
    there is deliberately no unicode normalizer (NFC would break decode(encode(s)) == s);
  * pre-tokenization splits words, single digits, punctuation runs and whitespace runs the way
    Qwen2-family tokenizers do, so numbers are tokenized digit by digit;
  * 8185 learned tokens (256 bytes + merges) followed by 7 added tokens in ChatML/Qwen style,
    8192 ids in all. <tool_call>, </tool_call>, <think> and </think> are added but not special,
    as in Qwen3: decode(skip_special_tokens=True) keeps them so tool calls and reasoning can be
    parsed out of generated text.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parent.parent
CORPUS_DIR = REPO / "scripts" / "tokenizer_corpus"
DATA_DIR = REPO / "prefixserve" / "tokenizer" / "data"

VOCAB_SIZE = 8192
# (content, special): order fixes the ids at the end of the vocabulary.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<think>", False),
    ("</think>", False),
)
MIN_FREQUENCY = 2
# Contractions, letter runs (with one leading non-letter such as a space), single digits,
# punctuation runs with their trailing newlines, newline runs, then other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def training_files() -> list[Path]:
    corpus = sorted(CORPUS_DIR.glob("*.txt"))
    if not corpus:
        raise SystemExit(f"no corpus files in {CORPUS_DIR}")
    project = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")),
               *sorted((REPO / "prefixserve").rglob("*.py"))]
    return corpus + [p for p in project if p.is_file()]


def build_untrained() -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train(files: list[Path]) -> Tokenizer:
    tok = build_untrained()
    learned = VOCAB_SIZE - len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=learned, min_frequency=MIN_FREQUENCY, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    texts = [f.read_text(encoding="utf-8") for f in files]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != learned:
        raise SystemExit(f"the corpus yields only {tok.get_vocab_size()} learned tokens, {learned} are needed: "
                         f"add text to {CORPUS_DIR}")
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    ids = [tok.token_to_id(content) for content, _ in ADDED_TOKENS]
    if ids != list(range(learned, VOCAB_SIZE)):
        raise SystemExit(f"added tokens got ids {ids}, expected {learned}..{VOCAB_SIZE - 1}")
    return tok


def manifest(files: list[Path]) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "min_frequency": MIN_FREQUENCY,
        "files": [{"path": f.relative_to(REPO).as_posix(), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                  for f in files],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="retrain and compare with the shipped tokenizer.json instead of writing")
    args = parser.parse_args(argv)
    files = training_files()
    tok = train(files)
    serialized = tok.to_str(pretty=True)
    target = DATA_DIR / "tokenizer.json"
    if args.check:
        same = target.is_file() and json.loads(target.read_text(encoding="utf-8")) == json.loads(serialized)
        print("identical to the shipped tokenizer.json" if same else "differs from the shipped tokenizer.json")
        return 0 if same else 1
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    target.write_text(serialized + "\n", encoding="utf-8")
    (DATA_DIR / "training_manifest.json").write_text(json.dumps(manifest(files), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {target} ({tok.get_vocab_size()} ids) from {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
