"""Real-execution backends: the simulator's policies executed on real torch kernels.

:mod:`backends.torch_backend` runs on one CUDA GPU plus the CPU, or, with
``device="cpu"``, entirely on the CPU (the GPU stand-in is a host thread and
host memory). torch is imported by these modules; import them only when a
real run is asked for.
"""
