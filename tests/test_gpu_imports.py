"""The GPU code imports without a GPU, so CI catches a renamed module or name the GPU machine would trip on.
(The GPU test modules skip themselves before their own imports where there is no device.)"""
import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import minillm.cuda

TESTS = Path(__file__).parent
GPU_TEST_MODULES = sorted(p for p in TESTS.glob("test_*.py") if "cupy_with_a_device()" in p.read_text())


CUDA_MODULES = sorted(m.name for m in pkgutil.walk_packages(minillm.cuda.__path__, "minillm.cuda."))


@pytest.mark.parametrize("name", CUDA_MODULES)
def test_every_cuda_module_imports_without_a_gpu(name):
    importlib.import_module(name)


def test_the_dev_modules_are_found():
    assert {"minillm.cuda.dev.gemv", "minillm.cuda.dev.attention", "minillm.cuda.dev.selfcheck"} <= set(CUDA_MODULES)


def test_the_gpu_test_modules_are_found():
    assert {"test_cuda.py", "test_cuda_quant.py", "test_cuda_kv_int8.py"} <= {p.name for p in GPU_TEST_MODULES}


@pytest.mark.parametrize("path", GPU_TEST_MODULES, ids=lambda p: p.name)
def test_what_a_gpu_test_module_imports_from_minillm_exists(path):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minillm"):
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)
                       and not _is_submodule(node.module, a.name)]
            assert not missing, f"{path.name}: {node.module} has no {missing}"


def _is_submodule(package: str, name: str) -> bool:
    try:
        importlib.import_module(f"{package}.{name}")
        return True
    except ModuleNotFoundError:
        return False
