"""Every project path the documentation cites exists.

A cited path is a backticked token (or a Markdown link target) in ``README.md`` or ``docs/*.md``
whose first component is a top-level file or folder of the repository (``router/records.py``,
``fleet/presets/``, ``tests/router/test_workers.py``); a ``:line`` or ``::test`` suffix is dropped, a
glob must match something. Paths of other trees cited beside ours (SGLang's ``managers/...``,
``python/sglang/srt/``) start with a name the repository does not have and are not checked;
neither are placeholders (``<run>/<format>/CURRENT``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])

# Files the documentation tells the user to create; they are not in the repository.
USER_CREATED = {"deploy/prometheus/mixfleet_api_key"}

_BACKTICKED = re.compile(r"`([^`\s]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def cited_paths(text: str) -> set[str]:
    """The project paths ``text`` cites (see the module docstring)."""
    top = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
    out = set()
    for token in _BACKTICKED.findall(text) + _LINK.findall(text):
        path = token.split("::")[0].split(":")[0].split("#")[0]
        if "/" not in path or any(c in path for c in "<>{}$") or "://" in token:
            continue
        if path.split("/")[0] in top:
            out.add(path)
    return out


def test_cited_paths_are_recognised() -> None:
    text = "`router/records.py` `python/sglang/srt/` `<run>/<format>/CURRENT` [a](docs/metrics.md)"
    assert cited_paths(text) == {"router/records.py", "docs/metrics.md"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_cited_path_exists(doc: Path) -> None:
    missing = sorted(
        path
        for path in cited_paths(doc.read_text())
        if path not in USER_CREATED and not (any(REPO.glob(path)) if "*" in path else (REPO / path).exists())
    )
    assert not missing, f"{doc.relative_to(REPO)} cites paths that do not exist: {', '.join(missing)}"
