"""Triton and CUDA kernels with thin launchers. No engine logic lives here."""
