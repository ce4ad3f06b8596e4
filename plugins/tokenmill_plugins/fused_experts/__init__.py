"""Fused experts kernels (slot ``fused_expert``) beside the core's ``torch`` reference."""
