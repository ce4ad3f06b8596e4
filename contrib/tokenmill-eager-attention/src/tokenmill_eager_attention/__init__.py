"""tokenmill plugin: registers the ``eager`` attention backend.

Only the registration lives here; the backend module is imported when a
config selects ``eager``, so listing plugins stays cheap.
"""

from tokenmill import hookimpl


@hookimpl
def tokenmill_register_attention_backends(register):
    register("eager", "tokenmill_eager_attention.backend:EagerAttentionBackend")
