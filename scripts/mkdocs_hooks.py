"""MkDocs hooks (mkdocs.yml).

- README.md becomes the site's home page and CHANGELOG.md a page, read from the
  repository's root, with their links and the docs' links to them rewritten for the
  site, so every page exists once and links work on GitHub and on the site alike.
- The API reference reads cswap laid out as installed: kernels/ and models/ are
  cswap.kernels and cswap.models (setuptools package-dir), which griffe cannot see in
  the source tree. build/docs-api/cswap is a copy of the package with those two inside.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
FROM_ROOT = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}


@event_priority(100)  # before mkdocstrings reads its paths: the first build of a clean checkout
def on_config(config):
    tree = ROOT / "build" / "docs-api" / "cswap"
    if tree.exists():
        shutil.rmtree(tree)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "cswap", tree, ignore=skip)  # copies: griffe resolves links to where they point
    for sub in ("kernels", "models"):
        shutil.copytree(ROOT / sub, tree / sub, ignore=skip)
    return config


def on_files(files, config):
    for name, source in FROM_ROOT.items():
        files.append(File.generated(config, name, content=(ROOT / source).read_text()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri in FROM_ROOT:  # links from the root: docs/x.md is x.md here
        markdown = re.sub(r"\]\(docs/", "](", markdown)
        markdown = markdown.replace("](CHANGELOG.md", "](changelog.md").replace("](README.md", "](index.md")
    else:  # links from docs/ up to the root's pages
        markdown = markdown.replace("](../README.md", "](index.md").replace("](../CHANGELOG.md", "](changelog.md")
    return markdown
