"""The docs site builds offline from the notebooks and renders in headless Chromium.

Builds with tools/build_docs.py into tmp_path, then loads pages from disk (file://) in Chromium with
name resolution disabled, so anything that needs the network fails to load.

While the committed notebooks carry no outputs yet, the index and `04_layers` are executed into
tmp_path first (never in nbs/), so the figure check has something to find. Once `04_layers` is
committed with outputs the test uses nbs/ as it is, and a missing figure fails.
"""
from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"
CHROMIUM_TIMEOUT = 60


def _load_build_docs():
    spec = importlib.util.spec_from_file_location("build_docs", ROOT / "tools" / "build_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _chromium() -> str:
    for c in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium"):
        if c and os.path.exists(c): return c
    msg = "chromium not found (Debian: apt-get install chromium)"
    if os.environ.get("CI"): pytest.fail(f"{msg}; it is required when CI is set")
    pytest.skip(msg)


def _outputs(nb_path: Path) -> list[dict]:
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


def _execute_copy(src: Path, dest: Path):
    "Run a copy of `src` in `dest`'s folder, without its `nbdev_export()` cell (that would rewrite dspark/)."
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(src, as_version=4)
    nb.cells = [c for c in nb.cells if not (c.cell_type == "code" and "nbdev_export" in c.source)]
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=False,
                   resources={"metadata": {"path": str(dest.parent)}}).execute()
    nbformat.write(nb, dest)


def _notebook_dir(tmp_path: Path) -> Path:
    "nbs/ if `04_layers` has committed outputs, else a copy with the index and `04_layers` executed."
    if _outputs(NBS / "04_layers.ipynb"): return NBS
    alt = tmp_path / "nbs"
    alt.mkdir()
    for p in NBS.glob("*.ipynb"): shutil.copy2(p, alt / p.name)
    for name in ("index.ipynb", "04_layers.ipynb"):
        if (NBS / name).exists(): _execute_copy(NBS / name, alt / name)
    return alt


class _Text(HTMLParser):
    "Visible text of a DOM dump (scripts and styles left out)."
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self._skip = [], 0
    def handle_starttag(self, tag, attrs): self._skip += tag in ("script", "style")
    def handle_endtag(self, tag): self._skip -= tag in ("script", "style") and self._skip > 0
    def handle_data(self, data):
        if not self._skip: self.parts.append(data)


def _text(dom: str) -> str:
    p = _Text()
    p.feed(dom)
    return re.sub(r"\s+", " ", html.unescape(" ".join(p.parts)))


def _chrome(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"chrome-profile-{name}"
    profile.mkdir()
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND",  # no network, ever
           f"--user-data-dir={profile}", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium timed out after {CHROMIUM_TIMEOUT} s: {' '.join(cmd)}")
    assert r.returncode == 0, f"chromium failed (exit {r.returncode}):\n{r.stderr[-3000:]}"
    return r


def _dump_dom(tmp_path: Path, page: Path, name: str) -> str:
    dom = _chrome(tmp_path, name, "--dump-dom", page.as_uri()).stdout
    assert "<html" in dom.lower(), f"no DOM for {page}:\n{dom[:500]}"
    return dom


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    out = _load_build_docs().build(tmp / "site", nbs_dir=_notebook_dir(tmp))
    return out


def test_site_files(site):
    names = {p.name for p in site.iterdir()}
    assert {"index.html", "04_layers.html"} <= names
    # every numbered notebook became a page, in the nav of the index
    index = (site / "index.html").read_text(encoding="utf-8")
    for nb in sorted(NBS.glob("[0-9]*.ipynb")):
        assert (site / f"{nb.stem}.html").exists(), nb.stem
        assert f'href="{nb.stem}.html"' in index, f"{nb.stem} missing from the nav"


def test_index_renders(site, tmp_path):
    dom = _dump_dom(tmp_path, site / "index.html", "index")
    text = _text(dom)
    assert "literate, notebook-first serving engine" in text
    assert re.search(r'class="[^"]*jp-CodeCell', dom) and "<pre" in dom, "no code cell on the index page"
    assert 'class="md-nav' in dom, "material navigation missing"


def test_layers_page_renders(site, tmp_path):
    page = site / "04_layers.html"
    dom = _dump_dom(tmp_path, page, "layers")
    text = _text(dom)
    assert "def rms_norm(" in text, "code missing"
    assert "Sinkhorn" in text, "prose missing"
    assert "#|" not in text, "nbdev directives leaked into the page"
    assert "nbdev_export" not in text, "a `#| hide` cell leaked into the page"
    imgs = re.findall(r"<img\b[^>]*>", dom)
    assert any(re.search(r'src="(data:image/png;base64,|[^"]+\.png")', i) for i in imgs), \
        f"no PNG figure on the page ({len(imgs)} <img> tags)"

    shot = tmp_path / "04_layers.png"
    _chrome(tmp_path, "shot", f"--screenshot={shot}", "--window-size=1280,3600", "--hide-scrollbars",
            page.as_uri())
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no screenshot"
    assert shot.stat().st_size > 10_000, f"screenshot is suspiciously small ({shot.stat().st_size} bytes)"
    if os.environ.get("DSPARK_DOCS_SHOT"): shutil.copy2(shot, os.environ["DSPARK_DOCS_SHOT"])
