"""Where the folders minillm ships beside its code live: kernels/ (the CUDA sources) and lessons/.

In a source checkout (or an editable install of one) they are the checkout's top-level folders, where
the README puts them. A built wheel carries copies inside the package, as minillm/kernels and
minillm/lessons (setup.py's build step copies them), so an installed minillm reads those.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT_DIR = PACKAGE_DIR.parent           # the repository root, when this is a source checkout


def data_dir(name: str) -> Path:
    """The shipped folder `name` ("kernels" or "lessons"): the checkout's, else the installed copy."""
    checkout = CHECKOUT_DIR / name
    if (CHECKOUT_DIR / "setup.cfg").is_file() and checkout.is_dir():
        return checkout
    return PACKAGE_DIR / name


def import_root() -> Path:
    """The folder that holds the `minillm` package: what a subprocess needs on its PYTHONPATH."""
    return CHECKOUT_DIR
