"""The README: a page a newcomer reads in five minutes, with the two set-up commands.
Its Python example runs with the site's (tests/test_docs.py)."""

from __future__ import annotations

import re

from tests._docs import README, ROOT


def test_readme_has_the_two_setup_commands() -> None:
    text = README.read_text()
    assert "pip install -e . && .venv/bin/stagedconsumer demo" in text
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = re.search(r"^python3 -m venv .* -m pytest.*$", ci, re.M)
    assert test_command is not None
    assert test_command.group(0) in text


def test_readme_is_short_and_says_how_to_build_the_site() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    assert "mkdocs serve" in text


def test_readme_links_into_the_site_resolve() -> None:
    """The README is read on its own (on GitHub, in an editor): its relative links name
    pages of docs/ that exist, and headings that those pages have."""
    text = README.read_text()
    links = re.findall(r"\]\(((?!https?:)[^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links
    for target, anchor in links:
        path = ROOT / target
        assert path.is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{target}#{anchor}"
