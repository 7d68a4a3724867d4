"""Every relative link in the README and in `docs/` resolves: the file exists, and an anchor names a
heading of that file as GitHub spells it (`anchor`). Links inside code blocks and spans are not
links; absolute URLs are not checked (tests stay off the network).

Typical use::

    broken_links(Path("README.md"))  # ["README.md: docs/nope.md (no such file)", ...]
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor `page`'s headings give, a repeated one numbered `-1`, `-2` as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = anchor(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` that names no file, or no heading of the file it names."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{page.name}: {target} (no heading #{fragment} in {linked.name})")
    return broken


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_a_missing_file_or_heading_is_reported_and_code_is_not_read_as_links(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## `auto`: sparse or dense\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#auto-sparse-or-dense) [ok](other.md#twice-1) [ok](#here) [web](https://example.com/x)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) `[span](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n\n## Here\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nowhere (no heading #nowhere in other.md)",
    ]
