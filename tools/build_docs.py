#!/usr/bin/env python
"""Build the dspark docs site offline from the notebooks in `nbs/`, with their committed outputs.

    python tools/build_docs.py [--out DIR] [--nbs DIR] [--stage DIR] [--allow-external]

Steps:

1. Stage `nbs/index.ipynb` and `nbs/[0-9]*.ipynb` into a scratch folder, cleaned the way nbdev
   renders them: `#| hide` / `#| include: false` cells are dropped, leading `#|` directive lines are
   removed (a cell with nothing left goes), `#| echo: false` hides the input, `#| output: false`
   the outputs. Notebooks are never executed: what is committed is what is shown.
2. Write an mkdocs config from `docs/mkdocs.yml` (material theme, `font: false`, mkdocs-jupyter with
   `execute: false`), nav = index first, then the numbered notebooks in filename order, titled by
   each notebook's first `# Heading`.
3. `python -m mkdocs build -f CONFIG -d OUT`; a failure exits non-zero.
4. Check that no page loads anything from the network (`<script src>`, `<img src>`, `<link href>`,
   CSS `url()`/`@import` to http(s)); any such reference fails the build unless `--allow-external`.

Importable: `build(out, nbs_dir=...) -> Path` returns the site folder.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DEFAULT_OUT = ROOT / "_build" / "site"
DEFAULT_NBS = ROOT / "nbs"

HIDE_INPUT_TAG = "dspark-hide-input"  # matched by remove_tag_config in docs/mkdocs.yml

_DIRECTIVE = re.compile(r"^\s*#\s*\|\s*([^\s:]+)\s*:?\s?(.*?)\s*$")
_BLANK = re.compile(r"^\s*$")
_H1 = re.compile(r"^#\s+(.+?)\s*#*\s*$", re.M)


class BuildError(RuntimeError):
    pass


# ---------------------------------------------------------------- notebook cleaning

def _source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def split_directives(source: str) -> tuple[dict[str, str], str]:
    """nbdev directives from the leading `#|` comment lines of a code cell, and the source without them.

    Like nbdev, only the leading block (directive lines, possibly with blank lines between them) counts;
    a bare directive has value `''`."""
    lines = source.splitlines(keepends=True)
    dirs: dict[str, str] = {}
    i = 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if m: dirs[m.group(1)] = "" if m.group(2) == "true" else m.group(2)
        elif not _BLANK.match(lines[i]): break
        i += 1
    return dirs, "".join(lines[i:]).strip("\n")


def _meta_directives(cell: dict) -> dict[str, str]:
    "Directives nbdev also accepts as cell metadata: `{\"nbdev\": {\"hide\": \"true\"}}`."
    d = (cell.get("metadata") or {}).get("nbdev") or {}
    return {k: ("" if v in ("true", True) else str(v)) for k, v in d.items()} if isinstance(d, dict) else {}


def _is_false(v: str) -> bool: return v.strip().lower() in ("false", "no", "0")


def clean_notebook(nb: dict) -> dict:
    "A copy of `nb` as it should be rendered: hidden cells dropped, directive lines removed, outputs kept."
    nb = copy.deepcopy(nb)
    cells = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            cells.append(cell)
            continue
        dirs, src = split_directives(_source(cell))
        dirs = {**_meta_directives(cell), **dirs}
        if "hide" in dirs and not _is_false(dirs["hide"]): continue
        if _is_false(dirs.get("include", "true")): continue
        if not src.strip(): continue                               # e.g. a lone `#| default_exp`
        cell["source"] = src
        if _is_false(dirs.get("output", "true")): cell["outputs"] = []
        if _is_false(dirs.get("echo", "true")):
            if not cell.get("outputs"): continue                   # nothing left to show
            md = cell.setdefault("metadata", {})
            md["tags"] = [*md.get("tags", []), HIDE_INPUT_TAG]
        cells.append(cell)
    nb["cells"] = cells
    return nb


def notebook_title(nb: dict, fallback: str) -> str:
    "The first `# Heading` of the notebook's markdown cells (before any code), else `fallback`."
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            m = _H1.search(_source(cell))
            if m: return m.group(1).strip()
    return fallback


def _fallback_index(chapters: list[tuple[str, str]]) -> str:
    "index.md for a tree with no nbs/index.ipynb: README.md if there is one, else the project description."
    readme = ROOT / "README.md"
    if readme.exists(): return readme.read_text(encoding="utf-8")
    desc = ""
    pyproject = ROOT / "pyproject.toml"
    if pyproject.exists():
        m = re.search(r'^description\s*=\s*"(.*)"\s*$', pyproject.read_text(encoding="utf-8"), re.M)
        if m: desc = m.group(1)
    body = "\n".join(f"- [{title}]({name.replace('.ipynb', '.md')})" for title, name in chapters)
    return f"# dspark\n\n> {desc}\n\n## Chapters\n\n{body}\n"


def _read_nb(p: Path) -> dict:
    try: return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e: raise BuildError(f"cannot read notebook {p}: {e}") from e


def stage_notebooks(nbs_dir: Path, docs_dir: Path) -> list[tuple[str, str]]:
    "Write cleaned notebooks into `docs_dir`; return the nav as `(title, filename)`, index first."
    nbs_dir = Path(nbs_dir)
    if not nbs_dir.is_dir(): raise BuildError(f"notebook folder not found: {nbs_dir}")
    numbered = sorted(p for p in nbs_dir.glob("[0-9]*.ipynb") if p.is_file())
    if not numbered: raise BuildError(f"no numbered notebooks (NN_name.ipynb) in {nbs_dir}")
    docs_dir.mkdir(parents=True, exist_ok=True)
    nav = []
    for p in numbered:
        nb = clean_notebook(_read_nb(p))
        (docs_dir / p.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False), encoding="utf-8")
        nav.append((notebook_title(nb, p.stem), p.name))
    index = nbs_dir / "index.ipynb"
    if index.exists():
        nb = clean_notebook(_read_nb(index))
        (docs_dir / "index.ipynb").write_text(json.dumps(nb, indent=1, ensure_ascii=False), encoding="utf-8")
        nav.insert(0, (notebook_title(nb, "Home"), "index.ipynb"))
    else:
        print(f"build_docs: warning: {index.relative_to(ROOT) if index.is_relative_to(ROOT) else index} "
              "not found; using a generated index page", file=sys.stderr)
        (docs_dir / "index.md").write_text(_fallback_index(nav), encoding="utf-8")
        nav.insert(0, ("Home", "index.md"))
    return nav


# ---------------------------------------------------------------- config

def write_config(stage_dir: Path, nav: list[tuple[str, str]]) -> Path:
    "mkdocs config in `stage_dir` from docs/mkdocs.yml, with docs_dir, nav, hooks and extra files filled in."
    cfg = yaml.safe_load((DOCS / "mkdocs.yml").read_text(encoding="utf-8"))
    docs_dir = stage_dir / "docs"
    for css in cfg.get("extra_css", []):
        shutil.copy2(DOCS / css, docs_dir / css)
    cfg["docs_dir"] = str(docs_dir)
    cfg["nav"] = [{title: name} for title, name in nav]
    cfg["hooks"] = [str(DOCS / "hooks.py")]
    path = stage_dir / "mkdocs.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


# ---------------------------------------------------------------- offline check

_EXT = re.compile(r"^\s*(https?:)?//", re.I)
_CSS_URL = re.compile(r"""(?:url\(\s*["']?|@import\s+["'])\s*((?:https?:)?//[^"')\s]+)""", re.I)


class _Refs(HTMLParser):
    "Collects `(what, url)` for resources a browser fetches to render a page (not plain `<a href>` links)."
    _SRC_TAGS = ("script", "img", "iframe", "audio", "video", "source", "embed", "track", "input")
    _LINK_RELS = ("stylesheet", "preload", "preconnect", "prefetch", "modulepreload", "icon", "manifest")

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str]] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag in self._SRC_TAGS and a.get("src"): self.refs.append((f"<{tag} src>", a["src"]))
        if tag in ("img", "source") and a.get("srcset"):
            self.refs += [(f"<{tag} srcset>", u.split()[0]) for u in a["srcset"].split(",") if u.strip()]
        if tag == "link" and a.get("href") and any(r in a.get("rel", "").lower() for r in self._LINK_RELS):
            self.refs.append((f"<link rel={a['rel']}>", a["href"]))
        if tag == "object" and a.get("data"): self.refs.append(("<object data>", a["data"]))
        if a.get("style"): self.refs += [("style=url()", u) for u in _CSS_URL.findall(a["style"])]
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        if tag == "style": self._in_style = False

    def handle_data(self, data):
        if self._in_style: self.refs += [("<style> url()", u) for u in _CSS_URL.findall(data)]


def external_refs(site: Path) -> dict[str, list[str]]:
    "`{relative path: [external resource refs]}` for the site's HTML and CSS files."
    found: dict[str, list[str]] = {}
    for f in sorted(site.rglob("*")):
        text = f.read_text(encoding="utf-8", errors="replace") if f.suffix in (".html", ".css") else None
        if text is None: continue
        if f.suffix == ".html":
            p = _Refs()
            p.feed(text)
            refs = [f"{what} {url}" for what, url in p.refs if _EXT.match(url)]
        else: refs = [f"url() {u}" for u in _CSS_URL.findall(text)]
        if refs: found[str(f.relative_to(site))] = sorted(set(refs))
    return found


# ---------------------------------------------------------------- build

def _check_out(out: Path):
    "mkdocs empties its output folder: refuse the repo root, its ancestors, and source folders or anything in them."
    if out == ROOT or out in ROOT.parents:
        raise BuildError(f"refusing to build into {out}: mkdocs wipes its output folder")
    for guarded in (ROOT / "nbs", DOCS, ROOT / "dspark", ROOT / "tools", ROOT / "tests", ROOT / ".git"):
        if out == guarded or guarded in out.parents:
            raise BuildError(f"refusing to build into {out}: mkdocs wipes its output folder")


def build(out: Path = DEFAULT_OUT, nbs_dir: Path = DEFAULT_NBS, *, stage: Path | None = None,
          allow_external: bool = False, quiet: bool = True) -> Path:
    "Build the site into `out` from the notebooks in `nbs_dir` (never executed); return `out`."
    out = Path(out).resolve()
    _check_out(out)
    tmp = None
    if stage is None: stage = Path(tmp := tempfile.mkdtemp(prefix="dspark_docs_"))
    else:
        stage = Path(stage).resolve()
        if (stage / "docs").exists(): shutil.rmtree(stage / "docs")
    try:
        nav = stage_notebooks(Path(nbs_dir), stage / "docs")
        config = write_config(stage, nav)
        cmd = [sys.executable, "-m", "mkdocs", "build", "--clean", "-f", str(config), "-d", str(out)]
        if quiet: cmd.append("--quiet")
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # material's end-of-life banner
        r = subprocess.run(cmd, cwd=stage, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise BuildError(f"mkdocs build failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
        if r.stderr.strip() and not quiet: print(r.stderr, file=sys.stderr, end="")
    finally:
        if tmp: shutil.rmtree(tmp, ignore_errors=True)
    if not (out / "index.html").exists(): raise BuildError(f"mkdocs wrote no {out / 'index.html'}")
    ext = external_refs(out)
    if ext:
        msg = "pages load resources from the network:\n" + "\n".join(
            f"  {page}: {', '.join(refs)}" for page, refs in ext.items())
        if not allow_external: raise BuildError(msg)
        print(f"build_docs: warning: {msg}", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="site folder (default: _build/site)")
    ap.add_argument("--nbs", type=Path, default=DEFAULT_NBS, help="notebook folder (default: nbs/)")
    ap.add_argument("--stage", type=Path, default=None, help="keep the cleaned notebooks and mkdocs.yml here")
    ap.add_argument("--allow-external", action="store_true", help="only warn about network resources")
    ap.add_argument("-v", "--verbose", action="store_true", help="show mkdocs' log")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = build(a.out, a.nbs, stage=a.stage, allow_external=a.allow_external, quiet=not a.verbose)
    except BuildError as e:
        print(f"build_docs: error: {e}", file=sys.stderr)
        return 1
    print(f"build_docs: site in {out} ({time.perf_counter() - t0:.1f} s); open {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
