"""The built-in speculators: ``ngram`` (prompt lookup), ``draft_model`` and ``medusa``.

Each drafts tokens that the core verifies (``tokenmill.speculative.speculator``); they are
selected with ``speculative_config.method`` (vLLM's ``--speculative-config``).
"""
