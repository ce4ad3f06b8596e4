"""First-party routers: ``least_loaded``, ``kv_aware``, ``prefix_aware`` and ``lora_aware`` (``server.router``,
``--router``).

Registered through the ``tokenmill`` entry point ``routers`` like any third-party plugin; options come from
the ``[plugins.routers]`` table (``RoutersOptions``). Nothing here imports torch: routers run in the front end.
"""
