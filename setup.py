"""Thin setuptools driver: configures and builds `dist_kernels._C` with CMake and Ninja.

Build options come from the environment (see README): DK_WITH_CUDA (0, 1, unset = auto),
DK_CUDA_ARCHS (default "80;90"), DK_BUILD_TYPE (default Release), DK_BUILD_JOBS.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def _cmake_args(extdir: Path) -> list:
    import pybind11

    args = [
        f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        f"-DCMAKE_BUILD_TYPE={os.environ.get('DK_BUILD_TYPE', 'Release')}",
    ]
    if "DK_WITH_CUDA" in os.environ:
        args.append(f"-DDK_WITH_CUDA={os.environ['DK_WITH_CUDA']}")
    if "DK_CUDA_ARCHS" in os.environ:
        args.append(f"-DDK_CUDA_ARCHS={os.environ['DK_CUDA_ARCHS']}")
    return args


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        extdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        # A cache from an earlier build may point at a deleted isolated build environment
        # (pybind11, cmake paths); dropping it makes every build configure afresh while
        # Ninja still reuses object files whose commands did not change.
        for stale in ("CMakeCache.txt", "CMakeFiles"):
            path = build_dir / stale
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()
        cmake = shutil.which("cmake") or "cmake"
        subprocess.run(
            [cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja", *_cmake_args(extdir)],
            check=True,
        )
        jobs = os.environ.get("DK_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)


setup(ext_modules=[CMakeExtension("dist_kernels._C")], cmdclass={"build_ext": CMakeBuild})
