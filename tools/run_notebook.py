"""Run a notebook's code cells in order, in one namespace, and record the stdout of chosen flagged cells.

Why this exists: cells flagged `#| gpu` are skipped by `nbdev-test` on CPU machines, but their recorded
outputs (the measurements) belong in the committed notebook and in the docs. The GPU machine has torch but
no Jupyter kernel, so this runner executes the notebook with plain `exec` (no IPython magics are used in
our notebooks), and writes the captured output back into the flagged cells only:

    python tools/run_notebook.py run nbs/06_model.ipynb --flag gpu --out OUT.ipynb    # on the GPU machine
    python tools/run_notebook.py merge OUT.ipynb nbs/06_model.ipynb --flag gpu        # back here

Cells whose source starts with `#| hide` (the `nbdev_export()` call) are not run. `merge` copies the
outputs of the flagged cells into the same cells (matched by source) of another copy of the notebook.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
import traceback
from pathlib import Path


def flags(src: str) -> set[str]:
    "The nbdev flags of a cell: words on its leading `#|` lines."
    out = set()
    for line in src.splitlines():
        if not line.startswith("#|"): break
        out.update(line[2:].split())
    return out


def run(nb_path: Path, flag: str, out_path: Path) -> int:
    nb = json.loads(nb_path.read_text())
    ns: dict = {"__name__": "__main__"}
    failures = 0
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code": continue
        src = "".join(cell["source"])
        fl = flags(src)
        if "hide" in fl: continue
        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf):
            try: exec(compile(src, f"<cell {i}>", "exec"), ns)
            except Exception:
                failures += 1
                print(traceback.format_exc())
        sys.stderr.write(f"cell {i} {sorted(fl)} {time.perf_counter() - t0:.1f}s\n")
        if flag in fl:
            cell["outputs"] = [{"name": "stdout", "output_type": "stream", "text": buf.getvalue().splitlines(True)}]
            sys.stdout.write(buf.getvalue())
    out_path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return failures


def merge(src: Path, dst: Path, flag: str) -> int:
    "Copy the outputs of `flag` cells of `src` into the cells of `dst` with the same source; returns the count."
    outs = {"".join(c["source"]): c["outputs"] for c in json.loads(src.read_text())["cells"]
            if c["cell_type"] == "code" and flag in flags("".join(c["source"]))}
    nb, n = json.loads(dst.read_text()), 0
    for c in nb["cells"]:
        key = "".join(c["source"]) if c["cell_type"] == "code" else None
        if key in outs: c["outputs"], n = outs[key], n + 1
    dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return n


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run"); r.add_argument("notebook", type=Path); r.add_argument("--out", type=Path, required=True)
    m = sub.add_parser("merge"); m.add_argument("src", type=Path); m.add_argument("dst", type=Path)
    for p in (r, m): p.add_argument("--flag", default="gpu", help="the cells whose outputs are recorded")
    a = ap.parse_args()
    if a.cmd == "run": sys.exit(1 if run(a.notebook, a.flag, a.out) else 0)
    print(f"merged {merge(a.src, a.dst, a.flag)} cell(s)")
