"""radiance-ar: hide the tensor-parallel all-reduce under the GEMM that produces it.

One import name, several rooms::

    radiance_ar.overlap      the op radiance::linear_ar, its pipeline, producers, vLLM installer
    radiance_ar.backends     all-reduce strategies behind one registry (stock, sdma, ...)
    radiance_ar.transport    worlds and the copy transport: copy engines, flags, peer memory, streams
    radiance_ar.wht6         the 6-bit Walsh-Hadamard codec: format, reference, kernels
    radiance_ar.launch       Triton launch helpers shared by every kernel
    radiance_ar.harness      process pools and emulated worlds for tests and tools
    radiance_ar.diagnostics  hardware checks (copy engines without compute units, host cost)

Leaves every room may import: ``envs`` (every setting), ``call_contract``,
``streams``, ``buffers``. Importing this package imports nothing else.
"""
