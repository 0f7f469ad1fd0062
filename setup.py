"""Builds cpu_kernels' C sources into one shared object with a plain compiler call.

No torch headers and no build dependency beyond setuptools: the library is loaded through
ctypes, so `pip install --no-build-isolation .` works on a machine with no registry. The
sources and flags live in cpu_kernels/_build.py (read here by path, without importing the
package), where the aarch64 emulation test reads them too.
"""

import os
import runpy
import sys

from setuptools import Extension, setup

_build = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels", "_build.py"))
compile_args = list(_build["COMPILE_ARGS"])
link_args = list(_build["LINK_ARGS"])
if sys.platform == "darwin":  # Apple clang has no -fopenmp; the kernels then run on one thread
    compile_args.remove("-fopenmp")
    link_args.remove("-fopenmp")

setup(
    ext_modules=[
        Extension(
            "cpu_kernels._native",
            sources=_build["SOURCES"],
            depends=_build["HEADERS"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    ]
)
