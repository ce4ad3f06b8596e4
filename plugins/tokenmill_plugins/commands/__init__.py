"""First-party command plugins: ``tokenmill bench``, ``eval``, ``quantize`` and ``train``.

Tools that a runtime does not need in order to serve. They reach the ``tokenmill`` command through the
``tokenmill`` entry point ``commands`` (``tokenmill_register_commands``), as a third-party command would.
"""
