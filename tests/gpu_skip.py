"""What every GPU test module starts with: CuPy and a CUDA device, or the whole module is skipped
(CI has neither; the GPU tests run on the GPU machine)."""
import pytest


def cupy_with_a_device():
    """The cupy module, or skip the calling test module (call it at module level, before GPU imports)."""
    cp = pytest.importorskip("cupy")
    try:
        n_devices = cp.cuda.runtime.getDeviceCount()
    except Exception:      # no driver, or a driver too old for this CuPy
        n_devices = 0
    if n_devices == 0:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cp


DTYPES = ["float16", "bfloat16"]


def ok(result):
    """Assert a minillm.cuda.dev check result: (error, tolerance)."""
    err, tol = result
    print(f"error {err:.3e} (tolerance {tol:.1e})")     # shown by pytest -rP: how close, not only whether
    assert err <= tol, f"error {err:.3e} > tolerance {tol:.1e}"
