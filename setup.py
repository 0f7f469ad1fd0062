"""Builds cpu_kernels' C sources into one shared object with a plain compiler call.

No torch headers and no build dependency beyond setuptools: the library is loaded through
ctypes, so `pip install --no-build-isolation .` works on a machine with no registry.
"""
import os
import sys

from setuptools import Extension, setup

SOURCES = ["cpu_kernels/csrc/module.c", "cpu_kernels/csrc/dispatch.c",
           "cpu_kernels/csrc/kernels_avx512.c", "cpu_kernels/csrc/kernels_avx2.c",
           "cpu_kernels/csrc/kernels_portable.c", "cpu_kernels/csrc/aio.c"]

compile_args = ["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
                "-Wall", "-Wno-unknown-pragmas"]
link_args = ["-fopenmp"]
if sys.platform == "darwin":  # Apple clang has no -fopenmp; the kernels then run on one thread
    compile_args.remove("-fopenmp")
    link_args.remove("-fopenmp")

setup(ext_modules=[Extension("cpu_kernels._native", sources=SOURCES,
                             depends=[os.path.join("cpu_kernels/csrc", f) for f in
                                      ("kernels.h", "adam_body.h", "aio.h")],
                             extra_compile_args=compile_args, extra_link_args=link_args)])
