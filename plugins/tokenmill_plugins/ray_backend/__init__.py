"""First-party engine backend ``ray``: ``tokenmill serve --backend ray`` places the engine replicas as Ray actors.

Registered through the ``tokenmill`` entry point ``ray_backend`` like any third-party plugin (slot
``engine_backend``, selected by ``server.backend``). It reads the ``server.ray_*`` settings of the config it is
built with. Ray is an optional extra (``pip install 'tokenmill[ray]'``): nothing imports it before the backend
connects (``backend.RayEngineBackend.connect``), so listing plugins never needs it.
"""
