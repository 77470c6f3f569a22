"""Run the `dspark` command from this checkout without installing it.

    python3 training/run_dspark.py train-draft --help

For machines where the project cannot be pip-installed (no registry): it maps the import names the way
pyproject.toml's package-dir does (`dspark` -> backend/dspark, its kernels inside it) and calls
`dspark.tools.cli.main`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _map_package(name: str, folder: Path) -> None:
    """Import `folder` as package `name`, so its submodules resolve inside it."""
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {folder} as {name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def main() -> int:
    """Map the packages, then hand the arguments to the `dspark` command."""
    _map_package("dspark", ROOT / "backend" / "dspark")
    from dspark.tools.cli import main as dspark_main

    return dspark_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
