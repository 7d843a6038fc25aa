"""The import contracts in pyproject.toml ([tool.importlinter]; docs/architecture.md): they hold on the tree, and a
deliberately wrong import breaks them. `lint-imports` runs as a subprocess on the tree and on a copy of the packages."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (the test extra)")


def lint(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the project's contracts, importing the packages found in `root`."""
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    """solrl/ and services/ (sources only) and pyproject.toml in a fresh directory."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "weights", "pb", "*.html")
    for pkg in ("solrl", "services"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold_on_the_tree() -> None:
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def _add_import(path: Path, line: str) -> None:
    text = path.read_text()
    head = "from __future__ import annotations\n"
    assert head in text
    path.write_text(text.replace(head, head + "\n" + line + "\n", 1))


def test_a_low_module_importing_the_services_breaks_the_forbidden_contract(copy: Path) -> None:
    _add_import(copy / "solrl" / "sampling" / "schedule.py", "import services  # noqa: F401")
    r = lint(copy)
    assert r.returncode != 0
    assert "the core does not import the services BROKEN" in r.stdout
    assert "solrl.sampling.schedule -> services" in r.stdout


def test_an_upward_import_breaks_the_layers_and_makes_a_circle(copy: Path) -> None:
    # the model interface reaching up into the rollout code that uses it
    _add_import(copy / "solrl" / "models" / "base.py", "import solrl.rollout  # noqa: F401")
    r = lint(copy)
    assert r.returncode != 0
    assert "solrl's layers BROKEN" in r.stdout and "no import circles in solrl BROKEN" in r.stdout
    assert "solrl.models is not allowed to import solrl.rollout" in r.stdout


def test_a_core_module_importing_the_shapes_bed_breaks_the_layers(copy: Path) -> None:
    # evaluation reaching up into the bed instead of asking the scorer for its metrics
    _add_import(copy / "solrl" / "engine" / "evaluate.py", "import solrl.shapes.metrics  # noqa: F401")
    r = lint(copy)
    assert r.returncode != 0
    assert "solrl's layers BROKEN" in r.stdout
    assert "solrl.engine is not allowed to import solrl.shapes" in r.stdout
    assert "solrl.engine.evaluate -> solrl.shapes.metrics" in r.stdout


def test_the_plumbing_importing_a_role_breaks_the_services_layers(copy: Path) -> None:
    # the shared plumbing reaching up into a role (as the stream workers once imported the roles' data planes)
    _add_import(copy / "services" / "common" / "errors.py", "import services.explorer.dataplane  # noqa: F401")
    r = lint(copy)
    assert r.returncode != 0
    assert "the services' layers BROKEN" in r.stdout
    assert "services.common is not allowed to import services.explorer" in r.stdout
    assert "services.common.errors -> services.explorer.dataplane" in r.stdout


def test_a_role_importing_another_role_breaks_the_services_layers(copy: Path) -> None:
    # the explorer borrowing the regenerator's code instead of what services/rollout shares
    _add_import(copy / "services" / "explorer" / "dataplane.py", "import services.regenerator.dataplane  # noqa: F401")
    r = lint(copy)
    assert r.returncode != 0
    assert "the services' layers BROKEN" in r.stdout
    assert "services.explorer is not allowed to import services.regenerator" in r.stdout
    assert "services.explorer.dataplane -> services.regenerator.dataplane" in r.stdout


def test_the_trainer_importing_the_rollout_package_breaks_its_contract(copy: Path) -> None:
    # the trainer taking the adapter headers from the rollout services' endpoint instead of services/common
    _add_import(copy / "services" / "trainer" / "server.py", "import services.rollout.adapter_endpoint  # noqa: F401")
    r = lint(copy)
    assert r.returncode != 0
    assert "only the rollout roles use services.rollout BROKEN" in r.stdout
    assert "services.trainer.server -> services.rollout.adapter_endpoint" in r.stdout


def test_the_core_reaches_the_shapes_bed_only_through_its_registries() -> None:
    """Importing the core loads nothing of solrl.shapes; the registries name the bed and import it when used."""
    core = ("solrl.config", "solrl.prompts", "solrl.models", "solrl.rewards", "solrl.engine.evaluate",
            "solrl.engine.loop", "solrl.engine.queue_loop", "solrl.deploy.fit", "solrl.deploy.layouts", "solrl.deploy.up")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core)
            + "print(sorted(m for m in sys.modules if m.startswith('solrl.shapes')))\n"
            + "from solrl.config import get_preset\nfrom solrl.prompts import load_prompt_set\n"
            + "from solrl.rewards import build_reward\n"
            + "get_preset('shapes-sol-rl'); load_prompt_set('shapes:train'); build_reward('shapes')\n"
            + "print(sorted(m for m in sys.modules if m.startswith('solrl.shapes')))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    before, after = r.stdout.strip().splitlines()[-2:]
    assert before == "[]"
    assert {"solrl.shapes.presets", "solrl.shapes.prompts", "solrl.shapes.reward"} <= set(ast.literal_eval(after))


def test_the_planner_memory_model_the_update_names_resolves() -> None:
    """The update names the planner's memory model instead of importing it (the planner sits above the engine): a
    moved or renamed planner must move the name with it."""
    from solrl.engine.update import MEMORY_MODEL
    from solrl.registry import load_entry

    fits, plan_error = (load_entry(ref) for ref in MEMORY_MODEL)
    assert callable(fits) and issubclass(plan_error, Exception)
