"""CuTe DSL kernels of cosa (installed as ``cosa.cute_kernels``).

``osk``: the ordered-skip attention kernel (stage 2); ``kap``: the proxy's two kernels (stage
1); ``aot``: the kernels exported ahead of time into libcosa, and their loader.  They need
nvidia-cutlass-dsl (and, for launching on a GPU, apache-tvm-ffi is used when present).
``plan_layout`` and ``rank_key`` are plain constants that ``cosa`` imports without the DSL, so
this package's ``__init__`` imports nothing.
"""
