"""First-party structured-output backends (slot ``structured_outputs_backend``,
``structured_outputs_config.backend``): ``guidance`` (llguidance, the default; also ``llguidance``) from the
entry point ``structured_outputs``, and ``xgrammar`` from the entry point ``xgrammar`` (`pip install
tokenmill[xgrammar]`). Each library is imported only when its backend is selected.
"""
