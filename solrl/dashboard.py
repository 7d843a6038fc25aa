"""The live run dashboard: one web page over a run directory, updating while the run goes.

Served by the trainer service's ops app (services mode) and by `solrl dashboard RUN_DIR` (embedded runs,
or any finished run). The page polls `GET /dashboard/api/run` (the run's config, metrics.jsonl records,
evaluated epochs and adapter-proxy calibrations, read from the directory at each call) and draws reward
curves, proxy agreement, loss and KL, stage times, the latest evaluation grid (`/dashboard/api/grid`) and the
run's config. It reads only files the run writes anyway, so it adds no work to the training and works for a
run in another process. Plain SVG and no external scripts: it works offline and on an air-gapped cluster.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

PAGE = Path(__file__).with_name("dashboard.html")


def _finite(x: Any) -> Any:
    """JSON has no NaN / Infinity: they become null (a missing point on a curve)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _records(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl, skipping a last line still being written."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _evals(run_dir: Path) -> list[dict[str, Any]]:
    """Evaluated epochs: epoch, mean reward, grid files (eval/epoch_NNNN/grid_Ksteps.png)."""
    out = []
    for d in sorted((run_dir / "eval").glob("epoch_*")):
        m = re.fullmatch(r"epoch_(\d+)", d.name)
        grids = sorted(g.name for g in d.glob("grid_*steps.png"))
        if not m or not grids:
            continue
        entry: dict[str, Any] = {"epoch": int(m.group(1)), "grids": grids}
        try:
            entry["mean_reward"] = json.loads((d / "eval.json").read_text()).get("mean_reward")
        except (OSError, json.JSONDecodeError):
            pass
        out.append(entry)
    return out


def run_state(run_dir: Path) -> dict[str, Any]:
    """Everything the page draws, read from the run directory now."""
    config: dict[str, Any] = {}
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    calibration, summary = [], None
    try:
        calibration = json.loads((run_dir / "calibration.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    try:   # a finished run's summary (whether a monitor alarm stopped it)
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    return _finite({"run_dir": str(run_dir), "config": config, "records": _records(run_dir / "metrics.jsonl"),
                    "summary": summary,
                    "evals": _evals(run_dir), "calibrations": [{k: c.get(k) for k in ("epoch", "chosen", "met_target")}
                                                               for c in calibration]})


def mount_dashboard(app: FastAPI, run_dir: Path | Callable[[], Path]) -> None:
    """Add /dashboard (the page), /dashboard/api/run and /dashboard/api/grid to `app`."""
    where = run_dir if callable(run_dir) else (lambda: Path(run_dir))

    @app.get("/dashboard", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @app.get("/dashboard/api/run")
    def api_run() -> JSONResponse:
        return JSONResponse(run_state(where()))

    @app.get("/dashboard/api/grid", response_model=None)
    def api_grid(epoch: int = Query(..., ge=0), steps: int | None = Query(None, ge=1)) -> FileResponse | JSONResponse:
        d = where() / "eval" / f"epoch_{epoch:04d}"
        grids = sorted(d.glob("grid_*steps.png"))
        if steps is not None:
            grids = [g for g in grids if g.name == f"grid_{steps}steps.png"]
        if not grids:
            return JSONResponse({"error": f"epoch {epoch}: no evaluation grid"
                                          + (f" at {steps} steps" if steps else "")}, status_code=404)
        return FileResponse(grids[0], media_type="image/png", headers={"Cache-Control": "no-store"})


def create_app(run_dir: Path) -> FastAPI:
    app = FastAPI(title=f"solrl dashboard: {run_dir}", docs_url=None, redoc_url=None, openapi_url=None)
    mount_dashboard(app, run_dir)

    @app.get("/")
    def root() -> HTMLResponse:
        return HTMLResponse('<meta http-equiv="refresh" content="0; url=/dashboard">')

    return app


__all__ = ["create_app", "mount_dashboard", "run_state"]
