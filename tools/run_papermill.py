"""Run every notebook end to end with papermill, with the small parameters CI uses.

`nbdev-test` already executes the notebooks in-process; this run adds what only a real Jupyter kernel gives:
papermill's parameter injection (notebooks that declare a `parameters` cell get the CPU-sized values in
`PARAMS`) and an executed copy of each notebook under `_build/executed/` for inspection. Cells flagged
`#| gpu` and the cells that export the package are removed first, as `nbdev-test` skips them.

    python tools/run_papermill.py [NOTEBOOK ...]
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import papermill

ROOT = Path(__file__).resolve().parent.parent
PARAMS: dict[str, dict] = {  # notebook stem -> papermill parameters for a CPU run
    "03_model": {"seq_len": 64},
}


def strip_flagged(nb: dict, flag: str = "gpu") -> dict:
    "Drop the code cells whose leading `#|` lines carry `flag`."
    def flagged(c):
        lines = "".join(c["source"]).splitlines()
        return any(flag in ln[2:].split() for ln in lines[: next((i for i, ln in enumerate(lines) if not ln.startswith("#|")), len(lines))])
    nb["cells"] = [c for c in nb["cells"] if not (c["cell_type"] == "code" and flagged(c))]
    return nb


def strip_export(nb: dict) -> dict:
    """Drop the cells that call `nbdev_export()` (each notebook's last): CI checks the export before this run, and each
    call re-exports the whole package from inside the kernel (~5 s a notebook on the CI machine), as `nbdev-test`
    skips them too."""
    nb["cells"] = [c for c in nb["cells"] if not (c["cell_type"] == "code" and "nbdev_export()" in "".join(c["source"]))]
    return nb


def main(paths: list[Path]) -> int:
    out_dir = ROOT / "_build" / "executed"; out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for nb_path in paths:
        t0 = time.perf_counter()
        nb = strip_export(strip_flagged(json.loads(nb_path.read_text())))
        with tempfile.NamedTemporaryFile("w", suffix=".ipynb", delete=False) as f: json.dump(nb, f)
        try:
            papermill.execute_notebook(f.name, str(out_dir / nb_path.name), parameters=PARAMS.get(nb_path.stem, {}),
                                       kernel_name="python3", language="python", cwd=str(nb_path.parent),
                                       progress_bar=False)
            print(f"ok     {nb_path.name} {PARAMS.get(nb_path.stem, {})} {time.perf_counter() - t0:.1f}s")
        except Exception as e:  # papermill raises PapermillExecutionError with the failing cell
            failed.append(nb_path.name)
            print(f"FAILED {nb_path.name}: {e}")
        finally: Path(f.name).unlink()
    return 1 if failed else 0


if __name__ == "__main__":
    args = [Path(a) for a in sys.argv[1:]] or sorted((ROOT / "nbs").glob("*.ipynb"))
    sys.exit(main(args))
