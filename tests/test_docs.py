"""The README stays a page a user reads (issue #22): at most 300 lines, no line of prose over 120
characters in it or in docs/, and every relative link in them pointing at a file that exists."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _name(path):
    return str(path.relative_to(ROOT))


def test_readme_is_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_docs_prose_lines_are_at_most_120_characters(path):
    # table rows may be wider where a row cannot be split; everything else wraps at 120
    long = [
        f"{_name(path)}:{n}: {len(line)} characters"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 120 and not line.lstrip().startswith("|")
    ]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_docs_relative_links_resolve(path):
    missing = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        file = (path.parent / target.split("#", 1)[0]).resolve()
        if not file.exists():
            missing.append(target)
        elif ROOT not in file.parents:
            missing.append(f"{target} (outside the repository)")
    assert not missing, f"{_name(path)} links to: {missing}"
