"""Every document the sources cite is in the repository's docs/ and holds the section cited.

A citation reads `docs/<NAME>.md` followed by zero or more section numbers, each behind a section
sign (ranges with a dash, lists with commas or "and"); invariants are cited by name, `INV-<n>`,
and live in docs/CACHE.md. Sources may not cite the design notes that a clone does not contain
(the architecture, runtime and anchors notes kept outside the repository) nor their invariant
numbers, and every section sign in a source must belong to a docs/ citation.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCANNED = ("v41_jax", "kernels_pallas", "scripts", "serving", "tests")
TOP_LEVEL = ("README.md", "BENCHMARKS.md")

S = "\u00a7"  # the section sign, spelled out so this file cites nothing itself
NUM = r"\d+(?:\.\d+)*"
CITE = re.compile(rf"docs/(\w+)\.md((?:(?:\s*,\s*|\s+and\s+|\s+){S}{NUM}(?:\s*-\s*{NUM})?)*)")
SECTION = re.compile(rf"{S}({NUM})(?:\s*-\s*({NUM}))?")
INVARIANT = re.compile(r"\bINV-(\d+)\b")
EXTERNAL = re.compile(r"(?<![\w/])(?:docs/)?(?:RUNTIME|ARCHITECTURE|ANCHORS)\.md")
OLD_INVARIANT = re.compile(r"\bI-\d+\b")


def _sources() -> list[Path]:
    files = [ROOT / name for name in TOP_LEVEL if (ROOT / name).is_file()]
    for top in SCANNED:
        for pattern in ("*.py", "*.md"):
            files += [p for p in (ROOT / top).rglob(pattern) if p.is_file()]
    return sorted(set(files))


SOURCES = _sources()


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _headings(doc: Path) -> list[str]:
    return [line for line in _text(doc).splitlines() if line.startswith("#")]


def _has_heading(doc: Path, label: str) -> bool:
    pattern = re.compile(rf"^#{{1,6}}[ \t]+{re.escape(label)}(?![\w.])")
    return any(pattern.match(h) for h in _headings(doc))


def test_sources_found():
    assert any(p.suffix == ".py" for p in SOURCES)


def test_cited_docs_and_sections_exist():
    bad = []
    for path in SOURCES:
        text = _text(path)
        for m in CITE.finditer(text):
            where = f"{path.relative_to(ROOT)}:{_line(text, m.start())}"
            doc = DOCS / f"{m.group(1)}.md"
            if not doc.is_file():
                bad.append(f"{where}: {m.group(0)!r}: no {doc.relative_to(ROOT)}")
                continue
            for sec in SECTION.finditer(m.group(2)):
                for label in filter(None, sec.groups()):
                    if not _has_heading(doc, label):
                        bad.append(f"{where}: {m.group(0)!r}: {doc.relative_to(ROOT)} has no "
                                   f"heading numbered {label}")
    assert not bad, "\n".join(bad)


def test_cited_invariants_exist():
    cache = DOCS / "CACHE.md"
    bad = []
    for path in SOURCES:
        text = _text(path)
        for m in INVARIANT.finditer(text):
            if not _has_heading(cache, m.group(0)):
                bad.append(f"{path.relative_to(ROOT)}:{_line(text, m.start())}: {m.group(0)} "
                           "is no heading of docs/CACHE.md")
    assert not bad, "\n".join(bad)


def test_no_citation_of_notes_outside_the_repository():
    bad = []
    for path in SOURCES:
        text = _text(path)
        for rx in (EXTERNAL, OLD_INVARIANT):
            for m in rx.finditer(text):
                bad.append(f"{path.relative_to(ROOT)}:{_line(text, m.start())}: {m.group(0)!r} "
                           "(cite docs/MODEL.md, docs/CACHE.md or an INV-<n> of docs/CACHE.md)")
    assert not bad, "\n".join(bad)


def test_every_section_sign_belongs_to_a_docs_citation():
    bad = []
    for path in SOURCES:
        text = _text(path)
        cited = [m.span() for m in CITE.finditer(text)]
        for i, ch in enumerate(text):
            if ch == S and not any(a <= i < b for a, b in cited):
                bad.append(f"{path.relative_to(ROOT)}:{_line(text, i)}: "
                           f"{text[max(0, i - 30): i + 10]!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", ["MODEL.md", "CACHE.md"])
def test_doc_section_numbers_are_unique(doc):
    labels = [h.lstrip("#").split()[0] for h in _headings(DOCS / doc) if len(h.lstrip("#").split()) > 1]
    numbered = [x for x in labels if re.fullmatch(rf"{NUM}|INV-\d+", x)]
    assert len(numbered) == len(set(numbered)), sorted(x for x in numbered if numbered.count(x) > 1)
