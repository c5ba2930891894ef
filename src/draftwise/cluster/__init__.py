"""draftwise across a Ray cluster: the API and the verifier as Ray Serve deployments, the bench on
Ray actors.

Nothing here imports Ray at module level: draftwise without Ray installed keeps working, and
``--ray`` says how to install it (``draftwise.cluster.runtime.require_ray``). Each module reuses
the one-machine code (``api.app.create_app``, ``remote.sessions.VerifierService``,
``bench.runner.UnitRunner``) rather than a copy of it:

* ``serve_app``: ``draftwise serve --ray``, one app per replica, ``/metrics`` for the whole fleet;
* ``verifier``: ``draftwise serve-verifier --ray``, sessions routed by their ID (Serve's model
  multiplexing), affinity hits and misses in ``/health``;
* ``bench``: ``draftwise bench --ray``, one prompt per unit on one worker, retried elsewhere if
  its worker dies;
* ``fleet``: what the replicas share (a board of their latest reports) and the Serve plumbing;
* ``runtime``: joining a cluster, or starting a local Ray bound to 127.0.0.1.

The settings of all of them (``ServeScale``, ``BenchWorkers``) are in ``draftwise.scale``,
below the servers and the bench that carry them.
"""
