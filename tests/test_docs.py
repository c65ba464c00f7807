"""The documentation site builds cleanly, has a page for every public name, and no internal link is broken.

The site is built once per test session (``sphinx-build -W --keep-going -b html docs <tmp>``, the command CI
and the README use): any warning fails the build, and so does ``docs/ext/coverage_check.py`` when a public
name of compjax has no entry.  The built HTML is then read with the standard library: every public name (see
:func:`coverage_check.public_groups`) has a page of its own (functions, classes and constants: the autosummary
page named after them; modules: their ``module-`` anchor), every notebook of ``colab/`` has a page, and every
relative ``href``/``src`` of every page points to a file that exists and, with a ``#fragment``, to an anchor
in it.  The coverage rule itself is a plain function, tried on a doctored list of documented names.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import zlib
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load_coverage_check():
    spec = importlib.util.spec_from_file_location("coverage_check", DOCS / "ext" / "coverage_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


coverage_check = _load_coverage_check()


class _Page(HTMLParser):
    """The ids and the relative links (href of a/link, src of img/script) of one HTML page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key):
                self.ids.add(attrs[key])
        url = {"a": attrs.get("href"), "link": attrs.get("href"), "img": attrs.get("src"),
               "script": attrs.get("src")}.get(tag)
        if url and not urlsplit(url).scheme and not url.startswith("//"):
            self.links.append(url)


def read_inventory(path: Path) -> set[str]:
    """The Python-domain names of a Sphinx ``objects.inv`` (version 2: 4 header lines, then zlib text)."""
    data = path.read_bytes()
    header = b"".join(data.splitlines(keepends=True)[:4])
    body = zlib.decompress(data[len(header):]).decode()
    names = set()
    for line in body.splitlines():
        m = re.match(r"(.+?)\s+(py:\w+)\s+-?\d+\s+\S+", line)
        if m:
            names.add(m.group(1))
    return names


def build(out: Path) -> dict:
    """Run sphinx-build into ``out``; its exit status, output tail and wall time."""
    env = {k: v for k, v in os.environ.items() if k != "COMPJAX_DOCS_NOTEBOOKS"}  # the committed notebooks
    started = time.perf_counter()
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", str(DOCS), str(out)]
    run = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    return {"returncode": run.returncode, "output": run.stdout[-3000:] + "\n" + run.stderr[-6000:],
            "seconds": time.perf_counter() - started}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site: (its folder, {page path relative to it: parsed page}), built once per test session.

    The build writes generated sources into docs/ (the notebooks' copies, autosummary's stubs), so two builds
    must not run at once: the pytest-xdist workers of a session share one build, made by the first that
    takes the lock.
    """
    if importlib.util.find_spec("sphinx") is None:
        pytest.fail("Sphinx is not installed: the docs tests need the dev extra (pip install -e '.[dev]')")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's, either way
    out, record = shared / "docs-html", shared / "docs-build.json"
    with open(shared / "docs-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            record.write_text(json.dumps(build(out)))
        result = json.loads(record.read_text())
    assert result["returncode"] == 0, (
        f"sphinx-build failed after {result['seconds']:.0f} s:\n{result['output']}")
    print(f"docs built in {result['seconds']:.0f} s")
    pages = {}
    for path in out.rglob("*.html"):
        parser = _Page()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[path.relative_to(out).as_posix()] = parser
    return out, pages


@pytest.mark.slow  # the docs build
def test_every_public_name_has_a_page(site):
    _, pages = site
    groups = coverage_check.public_groups()
    assert len(groups) > 150  # compjax.__all__, the public modules' __all__ and checkpoint's
    missing = []
    for group in groups:
        own = [f"api/_autosummary/{name}.html" for name in group
               if name in pages.get(f"api/_autosummary/{name}.html", _Page()).ids]
        module = [page for page, parsed in pages.items()
                  if any(f"module-{name}" in parsed.ids for name in group)]
        if not own and not module:
            missing.append(group[0])
    assert not missing, f"public names without a page: {missing}"


@pytest.mark.slow  # the docs build
def test_every_notebook_has_a_page(site):
    _, pages = site
    notebooks = sorted(p.stem for p in (ROOT / "colab").glob("*.ipynb"))
    assert notebooks and all(f"notebooks/{name}.html" in pages for name in notebooks)


@pytest.mark.slow  # the docs build
def test_no_broken_internal_link(site):
    out, pages = site
    broken = []
    checked = 0
    for page, parsed in sorted(pages.items()):
        if page.startswith("_static/"):  # the themes' template fragments, not pages
            continue
        for url in parsed.links:
            parts = urlsplit(url)
            target = (out / page).parent / unquote(parts.path) if parts.path else out / page
            target = target.resolve()
            checked += 1
            if not target.exists():
                broken.append(f"{page}: {url} (no such file)")
                continue
            if parts.fragment and target.suffix == ".html":
                anchors = pages[target.relative_to(out.resolve()).as_posix()].ids
                if unquote(parts.fragment) not in anchors:
                    broken.append(f"{page}: {url} (no anchor #{parts.fragment})")
    assert checked > 1000
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken[:50])


@pytest.mark.slow  # the docs build
def test_coverage_check_fails_when_an_entry_is_removed(site):
    out, _ = site
    documented = read_inventory(out / "objects.inv")
    groups = coverage_check.public_groups()
    assert coverage_check.undocumented(groups, documented) == []
    # remove the entry of one name: the check names it
    assert coverage_check.undocumented(groups, documented - {"compjax.topk"}) == ["compjax.topk"]
    # a re-export is documented under either of its names, and missing when neither has an entry
    both = {"compjax.payload_bytes", "compjax.accounting.payload_bytes"}
    assert both & documented
    assert coverage_check.undocumented(groups, documented - both) == ["compjax.accounting.payload_bytes"]
    # modules count too
    federated = {"compjax.algorithms.federated", "compjax.federated"}
    assert coverage_check.undocumented(groups, documented - federated) == ["compjax.algorithms.federated"]


def test_readme_links_point_to_files_that_exist():
    text = (ROOT / "README.md").read_text()
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in link]
    assert links
    missing = [link for link in links if link and not (ROOT / link).exists()]
    assert not missing, missing
