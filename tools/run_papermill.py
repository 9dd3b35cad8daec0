"""Run every notebook end to end with papermill, with the small parameters CI uses.

CI's one run of the notebooks (`nbdev-test`, the quicker local check, executes the same cells in-process but
skips those flagged slow or notest). A real Jupyter kernel per notebook gives papermill's parameter injection
(notebooks that declare a `parameters` cell get the CPU-sized values in `PARAMS`) and an executed copy of each
notebook under `_build/executed/` for inspection. Cells flagged `#| gpu` and the cells that export the package
are removed first, as `nbdev-test` skips them.

    python tools/run_papermill.py [--workers N] [NOTEBOOK ...]      (N: 2 by default)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import papermill

ROOT = Path(__file__).resolve().parent.parent
PARAMS: dict[str, dict] = {  # notebook stem -> papermill parameters for a CPU run
    "06_model": {"seq_len": 64},
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


def run_one(nb_path: Path, out_dir: Path) -> tuple[str, float, str | None]:
    "Execute one notebook (flagged and export cells removed): `(name, seconds, error or None)`."
    t0 = time.perf_counter()
    nb = strip_export(strip_flagged(json.loads(nb_path.read_text())))
    with tempfile.NamedTemporaryFile("w", suffix=".ipynb", delete=False) as f: json.dump(nb, f)
    try:
        papermill.execute_notebook(f.name, str(out_dir / nb_path.name), parameters=PARAMS.get(nb_path.stem, {}),
                                   kernel_name="python3", language="python", cwd=str(nb_path.parent),
                                   progress_bar=False)
        return nb_path.name, time.perf_counter() - t0, None
    except Exception as e:  # papermill raises PapermillExecutionError with the failing cell
        return nb_path.name, time.perf_counter() - t0, str(e)
    finally: Path(f.name).unlink()


def main(paths: list[Path], workers: int = 2) -> int:
    """Run the notebooks, `workers` kernels at a time. Each kernel then gets one thread for torch's CPU kernels
    (`OMP_NUM_THREADS=1`, inherited by the kernel processes): two kernels of two threads each on the 2-core CI
    machine oversubscribe it, and OpenMP's spinning threads then slow both several-fold."""
    out_dir = ROOT / "_build" / "executed"; out_dir.mkdir(parents=True, exist_ok=True)
    if workers > 1: os.environ["OMP_NUM_THREADS"] = "1"
    failed = []
    # worker processes, not threads: papermill changes the process's working directory while it starts a kernel
    with ProcessPoolExecutor(workers) as pool:
        for name, secs, err in pool.map(partial(run_one, out_dir=out_dir), [p.resolve() for p in paths]):
            print(f"ok     {name} {secs:.1f}s" if err is None else f"FAILED {name}: {err}", flush=True)
            if err is not None: failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    args, workers = sys.argv[1:], 2
    if args[:1] == ["--workers"]: workers, args = int(args[1]), args[2:]
    sys.exit(main([Path(a) for a in args] or sorted((ROOT / "nbs").glob("*.ipynb")), workers))
