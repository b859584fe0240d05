"""Build the demo model's corpus, tokenizer and token arrays (models/demo/SOURCE.md says what and why).

    python -m scripts.demo_data --out build/demo_data [--docs DIR] [--stdlib DIR] [--vocab 8192]

Sources (both PSF licence, see SOURCE.md):
  * the Python documentation's reStructuredText sources as Debian's python3-doc ships them
    (/usr/share/doc/python3.11/html/_sources/**/*.rst.txt), markup reduced to plain text;
  * the docstrings of the standard library's own modules (/usr/lib/python3.11/**/*.py), via `ast`.

Every document goes to the held-out split when a stable hash of its name falls in the last
1/HOLDOUT buckets, so the split does not depend on file order or on which files exist.

OUT receives:
  tokenizer.json          byte-level BPE (`tokenizers`), specials <bos> <eos> <pad> <noise> = ids 0-3
  train.npy, heldout.npy  uint16 token streams, each document <bos> text <eos>
  heldout_docs.json       the held-out documents as text (prompts and the small eval file come from it)
  stats.json              document / character / token counts per split
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

SPECIALS = ["<bos>", "<eos>", "<pad>", "<noise>"]   # ids 0-3: the config's bos/eos/pad/noise ids
HOLDOUT = 20                                          # 1 document in 20 is held out
DOCS = "/usr/share/doc/python3.11/html/_sources"
STDLIB = "/usr/lib/python3.11"

_DIRECTIVE = re.compile(r"^\s*\.\. [\w:-]+::.*$|^\s*\.\. _[^:]+:\s*$|^\s*:[\w-]+:.*$")
_ROLE = re.compile(r":[\w:+-]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_RULE = re.compile(r"^([=\-~*^#+\"'`.])\1{3,}\s*$")


def rst_to_text(src: str) -> str:
    """reST -> plain prose: directives, option lines, heading rules and targets dropped; roles and
    inline literals reduced to their text. Code examples stay (they are part of the docs' text)."""
    lines = []
    for line in src.splitlines():
        if _DIRECTIVE.match(line) or _RULE.match(line):
            continue
        line = _ROLE.sub(r"\1", line)
        line = line.replace("``", "").replace("**", "").replace("::", ":")
        line = re.sub(r"`([^`<]+?)(?:\s*<[^>]*>)?`_+", r"\1", line)
        lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def docstrings(path: Path) -> str:
    """A module's docstrings (module, classes, functions) in source order, blank-line separated."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    parts = [ast.get_docstring(n) for n in nodes]
    return "\n\n".join(p.strip() for p in parts if p and len(p.strip()) > 40)


def collect(docs_dir: str, stdlib_dir: str) -> list[tuple[str, str]]:
    """(name, text) of every document, sorted by name."""
    out = []
    for p in sorted(Path(docs_dir).rglob("*.rst.txt")):
        text = rst_to_text(p.read_text(encoding="utf-8", errors="replace"))
        if len(text) > 200:
            out.append((f"docs/{p.relative_to(docs_dir)}", text))
    for p in sorted(Path(stdlib_dir).rglob("*.py")):
        rel = p.relative_to(stdlib_dir)
        if rel.parts[0] in ("test", "idlelib", "lib2to3", "site-packages", "dist-packages") or "tests" in rel.parts:
            continue   # test suites' docstrings are mostly test names
        text = docstrings(p)
        if len(text) > 200:
            out.append((f"stdlib/{rel}", text))
    return out


def is_heldout(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HOLDOUT == 0


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
    ids = [np.asarray([bos] + e.ids + [eos], np.uint16) for e in tok.encode_batch(texts)]
    return np.concatenate(ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--docs", default=DOCS)
    ap.add_argument("--stdlib", default=STDLIB)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    corpus = collect(args.docs, args.stdlib)
    train = [t for n, t in corpus if not is_heldout(n)]
    held = [(n, t) for n, t in corpus if is_heldout(n)]
    tok = train_tokenizer(train, args.vocab)   # trained on the training split alone
    tok.save(os.path.join(args.out, "tokenizer.json"))
    streams = {"train": encode_stream(tok, train), "heldout": encode_stream(tok, [t for _, t in held])}
    for split, arr in streams.items():
        np.save(os.path.join(args.out, f"{split}.npy"), arr)
    with open(os.path.join(args.out, "heldout_docs.json"), "w") as f:
        json.dump([{"name": n, "text": t} for n, t in held], f)
    stats = {"documents": {"train": len(train), "heldout": len(held)},
             "chars": {"train": sum(map(len, train)), "heldout": sum(len(t) for _, t in held)},
             "tokens": {k: int(v.size) for k, v in streams.items()}, "vocab": tok.get_vocab_size()}
    with open(os.path.join(args.out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
