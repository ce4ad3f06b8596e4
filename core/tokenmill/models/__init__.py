"""Model architectures: ``ArchitectureConfig`` (a checkpoint's shape), ``CausalLM``
(what every architecture provides) and the Llama family. ``plugin`` registers
them without importing torch.
"""
