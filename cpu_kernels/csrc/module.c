/* Makes the kernel library an importable extension so setuptools builds and installs it;
 * the Python binding loads the same file through ctypes (no torch headers, no pybind). */
#include <Python.h>

static struct PyModuleDef native_module = {PyModuleDef_HEAD_INIT, "_native",
                                           "cpu_kernels C library (used through ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
