"""Sphinx configuration of the compjax documentation.

Build (from the repository root, with the ``docs`` or ``dev`` extra installed)::

    .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

The notebooks of ``colab/`` are rendered as they are committed, with the outputs of their short settings
(``colab/run_all.py --store``; ``nb_execution_mode = "off"``: the build executes nothing).  To show another run's
outputs, point ``COMPJAX_DOCS_NOTEBOOKS`` at its executed copies: ``COMPJAX_DOCS_NOTEBOOKS=runs/notebooks``.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "ext"))

import compjax

# -- Generated sources (git-ignored): the notebooks' copies and autosummary's stub pages ---------------------


def _copy_notebooks() -> None:
    """Copy ``colab/*.ipynb`` (or the executed copies ``COMPJAX_DOCS_NOTEBOOKS`` names) to docs/notebooks/."""
    source = Path(os.environ.get("COMPJAX_DOCS_NOTEBOOKS") or ROOT / "colab")
    if not source.is_absolute():
        source = ROOT / source
    target = DOCS / "notebooks"
    target.mkdir(exist_ok=True)
    wanted = {p.name for p in (ROOT / "colab").glob("*.ipynb")}
    for stale in target.glob("*.ipynb"):
        if stale.name not in wanted:
            stale.unlink()
    for name in sorted(wanted):
        src = source / name if (source / name).exists() else ROOT / "colab" / name
        dst = target / name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copyfile(src, dst)


_copy_notebooks()
# Stubs of names that are no longer public would be pages outside every toctree: start afresh.
shutil.rmtree(DOCS / "api" / "_autosummary", ignore_errors=True)

# -- Project ------------------------------------------------------------------------------------------------

project = "compjax"
author = "compjax contributors"
copyright = "compjax contributors"
version = release = compjax.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.linkcode",
    "myst_nb",
    "coverage_check",
]

templates_path = ["_templates"]
exclude_patterns = ["_build", "ext", "_templates", "**.ipynb_checkpoints", "results_summary.py"]
root_doc = "index"

# -- API reference ------------------------------------------------------------------------------------------

autosummary_generate = True
autosummary_ignore_module_all = False
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
add_module_names = True
python_display_short_literal_types = True


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields ("Alias for field number 0") are documented by the class's Attributes section."""
    doc = getattr(obj, "__doc__", None) or ""
    if what == "class" and doc.startswith("Alias for field number"):
        return True
    return None


#: Constants whose docstring would otherwise be their type's (``str``'s, ``int``'s).
DATA_DOCS = {"compjax.__version__": ["The version of the installed compjax, a string."]}


def _mend_docstring(app, what, name, obj, options, lines):
    """Give constants whose docstring is their type's their own line; keep constants' and properties' text."""
    own = inspect.getdoc(type(obj))
    if what in ("data", "attribute") and own and "\n".join(lines).strip() == own.strip():
        lines[:] = DATA_DOCS.get(name, [])
    if what in ("data", "attribute", "property"):
        _PLAIN[name] = list(lines)


#: Docstrings of constants and properties as written: napoleon would read "Outermost scope: ..." as
#: "type: description".
_PLAIN: dict[str, list[str]] = {}


def _keep_constant_docs(app, what, name, obj, options, lines):
    """After napoleon: give constants (``#:`` comments) and properties their docstring back as written."""
    if what in ("data", "attribute", "property") and name in _PLAIN:
        lines[:] = _PLAIN.pop(name)


def _lookup(dotted: str):
    """The object a dotted name names (None if it names nothing)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is None:
            continue
        obj = module
        for part in parts[i:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def _resolve_alias(app, env, node, contnode):
    """Link a docstring's reference to the entry of the object it names, under whichever public name it has.

    ``:func:`delayed_averaging``` in ``compjax.algorithms`` or ``:func:`compjax.accounting.payload_bytes```
    name objects documented as ``compjax.delayed_averaging`` and ``compjax.payload_bytes``: the entry of the
    same object if there is one, else the one entry whose name ends with the target.
    """
    from sphinx.util.nodes import make_refnode

    if node.get("refdomain") != "py":
        return None
    objects = env.get_domain("py").objects
    target = node.get("reftarget", "").lstrip("~.")
    candidates = [target] + ([f"{node['py:module']}.{target}"] if node.get("py:module") else [])
    wanted = {id(obj) for obj in map(_lookup, candidates) if callable(obj) or inspect.ismodule(obj)}
    matches = sorted(full for full in objects if wanted and id(_lookup(full)) in wanted)
    if not matches:
        matches = sorted(full for full in objects if full.endswith("." + target))
    if len(matches) != 1:
        return None
    entry = objects[matches[0]]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, matches[0])


def setup(app):
    app.connect("missing-reference", _resolve_alias)
    app.connect("autodoc-process-docstring", _mend_docstring, priority=400)  # before napoleon (500)
    app.connect("autodoc-process-docstring", _keep_constant_docs, priority=600)  # after it
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.add_css_file("custom.css")


#: [source] links of the API pages point at the repository.
REPOSITORY = "https://github.com/compjax/compjax"


def linkcode_resolve(domain, info):
    """The repository URL of an object's source lines (None when they cannot be found)."""
    if domain != "py" or not info.get("module"):
        return None
    obj = sys.modules.get(info["module"])
    for part in info["fullname"].split("."):
        obj = getattr(obj, part, None)
    try:
        obj = inspect.unwrap(obj)
        path = Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT)
        lines, start = inspect.getsourcelines(obj)
    except (TypeError, OSError, ValueError):
        return None
    return f"{REPOSITORY}/blob/main/{path.as_posix()}#L{start}-L{start + len(lines) - 1}"


# -- MyST and notebooks -------------------------------------------------------------------------------------

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "off"
# Markdown outputs (the notebooks' results tables) are MyST, which has tables; CommonMark has none.
nb_render_markdown_format = "myst"

# -- HTML ---------------------------------------------------------------------------------------------------

html_theme = "sphinx_book_theme"
html_title = "compjax"
html_static_path = ["_static"]
html_theme_options = {
    "repository_url": REPOSITORY,
    "use_repository_button": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    # The sidebar opens only the current page's branch: expanded everywhere, every page carried every one of the
    # 200-odd API pages' links, and the build took 71 s instead of 27 s on a 2-core machine.
    "collapse_navbar": True,
}
