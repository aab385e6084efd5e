"""The build step setup.cfg cannot say: ship the top-level kernels/ and lessons/ folders in the wheel.

They stay at the top of the checkout, where the README and the lessons point; a wheel gets copies as
minillm/kernels and minillm/lessons, which minillm.resources.data_dir finds in an installed package.
An editable install needs no copy: it reads the checkout's folders.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("kernels", "lessons")
# plots, caches, and the exercises' reference solutions: the repository holds them for teachers, a
# student's `pip install` does not
LEFT_OUT = shutil.ignore_patterns("out", "__pycache__", "*.pyc", ".pytest_cache", "solutions")


class BuildWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        root = Path(__file__).resolve().parent
        for name in SHIPPED:
            shutil.copytree(root / name, Path(self.build_lib) / "minillm" / name, dirs_exist_ok=True, ignore=LEFT_OUT)


setup(cmdclass={"build_py": BuildWithData})
