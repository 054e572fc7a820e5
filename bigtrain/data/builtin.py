"""Built-in real text that needs no network: Python's own reference documentation.

`pydoc_data.topics` ships with CPython (it backs `help("if")`): about 80 topics,
~460 KB of English prose and grammar from the language reference. It is the default
corpus, so `bigtrain train` with no arguments trains on real data offline.
"""
from __future__ import annotations

import hashlib
import sys

MIN_PARAGRAPH_CHARS = 40  # shorter paragraphs are headings and underlines, not text to classify
NEW_PARAGRAPH_SHARE = 0.8  # a topic mostly repeating a bigger one is a subsection of it: skip it


def _topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions strip it (e.g. minimal containers)
        raise ValueError("data.source='builtin' needs the stdlib module pydoc_data.topics, which this "
                         f"Python ({sys.version.split()[0]}) lacks; give a local text file or "
                         "data.source='synthetic'") from e
    return topics


def builtin_documents() -> list[str]:
    """The topics as documents, ordered by topic name so every run sees the same corpus."""
    topics = _topics()
    return [topics[name].strip() + "\n" for name in sorted(topics)]


def builtin_fingerprint() -> str:
    """Content hash of the corpus (it changes between Python releases)."""
    digest = hashlib.sha256()
    for doc in builtin_documents():
        digest.update(doc.encode("utf-8"))
        digest.update(b"\0")
    return "builtin-" + digest.hexdigest()[:16]


def builtin_classification(num_classes: int) -> tuple[list[str], list[int], list[str]]:
    """A real classification task: which reference topic does a paragraph come from?

    Classes are the `num_classes` largest topics that are not subsections of a larger one;
    paragraphs shared by two topics are kept only in the first, so no text has two labels.
    Returns (texts, labels, class names).
    """
    topics = _topics()
    seen: set[str] = set()
    texts: list[str] = []
    labels: list[int] = []
    names: list[str] = []
    for name in sorted(topics, key=lambda k: (-len(topics[k]), k)):
        if len(names) == num_classes:
            break
        paragraphs = [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) >= MIN_PARAGRAPH_CHARS]
        new = [p for p in dict.fromkeys(paragraphs) if p not in seen]
        if not new or len(new) < NEW_PARAGRAPH_SHARE * len(paragraphs):
            continue
        seen.update(new)
        texts += new
        labels += [len(names)] * len(new)
        names.append(name)
    if len(names) < num_classes:
        raise ValueError(f"data.num_classes={num_classes}: the builtin classification data has only "
                         f"{len(names)} classes; use data.num_classes <= {len(names)} or your own jsonl data")
    return texts, labels, names
