"""Attention backends: ``cpu`` (AVX2 C++ kernels), ``triton`` (Triton kernels) and ``cuda`` (a CUDA
decode kernel through CuPy).

``plugin`` only registers them (entry point ``attention``); the backend
modules, and with them their kernels, Triton and CuPy, are imported when a config selects one.
"""
