"""Every relative link in the README and docs/ points to a file that exists, and a link to a
heading of a Markdown page to a heading that page has (GitHub's anchors), so moving text between
pages cannot leave a reader at a dead end. No network: web addresses are not followed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `#` there is a shell comment, not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered."""
    found: set[str] = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def relative_links(page: Path) -> list[str]:
    text = "\n".join(prose_lines(page.read_text(encoding="utf-8")))
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans show syntax, not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_anchors_follow_githubs_rules(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# `threshold` (arXiv 2606.16112, the NAG MoD)\n## Notes\n## Notes\n"
                    "```bash\n# a shell comment\n```\n", encoding="utf-8")
    assert anchors(page) == {"threshold-arxiv-260616112-the-nag-mod", "notes", "notes-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {path})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading with the anchor #{anchor} in {file.name})")
    assert not broken, f"{page.relative_to(ROOT)} links to: " + "; ".join(broken)


def test_every_figure_in_docs_is_cited_by_a_page():
    """A figure no page shows is one a reader cannot place: current ones are cited by the results
    pages, superseded ones by the archive (results_history.md), or they are deleted."""
    cited = {(page.parent / target.partition("#")[0]).resolve()
             for page in PAGES for target in relative_links(page)}
    figures = sorted((ROOT / "docs").rglob("*.png"))
    assert figures
    assert [f.relative_to(ROOT).as_posix() for f in figures if f.resolve() not in cited] == []


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) < 12_500
