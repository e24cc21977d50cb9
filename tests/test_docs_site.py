"""The docs site builds with `mkdocs build --strict` (mkdocs.yml turns a link to a missing page or
anchor into a warning, and strict turns every warning into a failed build), and the README, the
front page, stays short and links only to docs that exist."""
import os
import pathlib
import re
import subprocess
import sys
import unicodedata

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 12_500


def test_the_docs_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2.0, printed on every build
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (site / "index.html").is_file()
    assert (site / "benchmarks" / "results" / "index.html").is_file()


def test_the_readme_is_a_front_page():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; the rest belongs in docs/"
    text = README.read_text()
    # the two set-up commands come first, before any other code block
    first_block = re.search(r"```\w*\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make run", "make test"], commands


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (its default slugify), as the site
    and GitHub agree on for plain headings."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)              # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)      # links keep their text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: pathlib.Path) -> set[str]:
    anchors, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def test_every_readme_link_into_docs_resolves():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    into_docs = [link for link in links if link.startswith("docs/")]
    assert into_docs, "the README's map of the docs is gone"
    for link in into_docs:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README.md links to {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README.md links to {link}: no heading of {path} has that anchor"
    # and nothing links outside the repository's own files but the web
    for link in links:
        assert link.startswith(("docs/", "http://", "https://", "#")), link


def test_the_slugs_are_the_sites():
    assert _slug("Goodput against the peers' admission policies") == "goodput-against-the-peers-admission-policies"
    assert _slug("Live: `bouncer bench gateways`") == "live-bouncer-bench-gateways"
    assert _slug("Agents under WEKA's kv-cache-tester") == "agents-under-wekas-kv-cache-tester"


def test_the_troubleshooting_page_names_every_reason_bouncer_gives():
    """A reason added to the core without a word on what it means and whether to retry fails here."""
    from bouncer.core.outcomes import Reason

    page = (ROOT / "docs" / "operations" / "troubleshooting.md").read_text()
    missing = [reason.value for reason in Reason if f"`{reason.value}`" not in page]
    assert not missing, f"docs/operations/troubleshooting.md does not name {missing}"
