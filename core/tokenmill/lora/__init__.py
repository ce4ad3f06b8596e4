"""Multi-LoRA serving: adapters in the PEFT format over one base model, many in one batch (docs/lora.md).

- ``request``: ``LoRARequest``, which adapter a request runs with, and its prefix-cache salt (no torch);
- ``adapter``: reading and checking an adapter directory against the base model (no torch);
- ``kernels``: the ``lora_kernel`` slot (``LoRAKernels``: Punica's shrink and expand) and its torch reference;
- ``layers``: the adapter slots of one linear, added on top of its base matmul;
- ``manager``: the engine's adapters, cached on the host and placed in slots each step;
- ``registry``: the API front end's adapters by name (``--lora-modules``, load and unload at run time).
"""
