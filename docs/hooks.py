"""MkDocs hooks for the offline docs build (wired in by tools/build_docs.py).

mkdocs-jupyter's nbconvert template puts two CDN loaders into every notebook page:

* `<script src="https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/...">` plus its config block, and
* a `<script type="module">` that imports mermaid from cdnjs when a page has mermaid diagrams.

The site is built and read offline, so both are dropped: math stays as its TeX source (`$...$`),
code, prose and images (inline `data:` PNGs) need no script at all.
"""
from __future__ import annotations

import re

from jinja2 import BytecodeCache


class _MemoryBytecodeCache(BytecodeCache):
    "Compiled Jinja templates shared by all nbconvert exporters of one build (keyed by name and source checksum)."
    def __init__(self): self._store: dict[str, bytes] = {}
    def load_bytecode(self, bucket):
        if bucket.key in self._store: bucket.bytecode_from_string(self._store[bucket.key])
    def dump_bytecode(self, bucket): self._store[bucket.key] = bucket.bytecode_to_string()


def _share_template_cache():
    """mkdocs-jupyter builds two fresh nbconvert exporters per notebook and each recompiles the same
    ~10 Jinja templates (about half of the build time); share the compiled code instead."""
    from nbconvert.exporters.templateexporter import TemplateExporter
    if getattr(TemplateExporter, "_dspark_cached", False): return
    cache, create = _MemoryBytecodeCache(), TemplateExporter._create_environment
    def _create_environment(self):
        env = create(self)
        env.bytecode_cache = cache
        return env
    TemplateExporter._create_environment = _create_environment
    TemplateExporter._dspark_cached = True

_EXTERNAL_SCRIPT = re.compile(r"""<script\b[^>]*\bsrc\s*=\s*["']https?://[^"']*["'][^>]*>\s*</script>\s*""", re.I)
_INLINE_SCRIPT = re.compile(r"<script\b([^>]*)>(.*?)</script>\s*", re.I | re.S)
_MATHJAX_CFG = re.compile(r"<!-- (Load mathjax|MathJax configuration|End of mathjax configuration) -->\s*")


def _drop_cdn_inline(m: re.Match) -> str:
    attrs, body = m.group(1), m.group(2)
    if "text/x-mathjax-config" in attrs: return ""                      # config for the MathJax we removed
    if 'type="module"' in attrs and "mermaid" in body and re.search(r"https?://", body): return ""
    return m.group(0)


def strip_cdn(html: str) -> str:
    "Remove CDN script loaders (MathJax, mermaid) from a rendered page."
    html = _EXTERNAL_SCRIPT.sub("", html)
    html = _INLINE_SCRIPT.sub(_drop_cdn_inline, html)
    return _MATHJAX_CFG.sub("", html)


def on_startup(command, dirty) -> None:
    _share_template_cache()


def on_post_page(output: str, page, config) -> str:
    return strip_cdn(output)
