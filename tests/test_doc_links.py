"""Every relative link in the Markdown docs (README.md, docs/, benchmarks/RESULTS.md) reaches a
file that exists and, with ``#anchor``, a heading of that file (GitHub's heading ids)."""

import collections
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(
    ["README.md", os.path.join("benchmarks", "RESULTS.md")]
    + [os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(path: str) -> list[str]:
    """The file's lines outside fenced code blocks, with inline code spans removed."""
    lines, fenced = [], False
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: collections.Counter[str] = collections.Counter()
    ids = set()
    for line in prose(path):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            ids.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return ids


def links(doc: str) -> list[str]:
    return [m.group(1) for line in prose(os.path.join(ROOT, doc)) for m in LINK.finditer(line)]


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.join(ROOT, os.path.dirname(doc), path) if path else os.path.join(ROOT, doc)
        if not os.path.exists(full):
            broken.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            broken.append(f"{target}: no heading #{anchor}")
    assert broken == [], f"{doc}: {broken}"


def test_slugs_as_github_writes_them():
    assert slug("Monitoring: Prometheus and Grafana") == "monitoring-prometheus-and-grafana"
    assert slug("Under load and faults") == "under-load-and-faults"
    assert slug("`--model_path` and L3") == "--model_path-and-l3"
