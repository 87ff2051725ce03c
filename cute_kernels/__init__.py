"""CuTe DSL kernels of cosa (installed as ``cosa.cute_kernels``).

Import ``cosa.cute_kernels.osk`` for the ordered-skip attention kernel; it needs
nvidia-cutlass-dsl (and, for launching on a GPU, apache-tvm-ffi is used when present).
"""
