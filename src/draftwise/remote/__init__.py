"""Remote verification: the drafter runs here, the target runs behind a verifier server.

One HTTP round trip per drafted block. The server keeps each session's context and KV
cache, so a request carries only the proposed block (plus, in sampling mode, the draft
distribution's non-zero entries), and the server applies the same ``LocalTarget`` code the
local engine uses.

* ``draftwise.remote.protocol``: the wire format (shared by both ends).
* ``draftwise.remote.sessions``: ``VerifierService``, the sessions over the loaded target.
* ``draftwise.remote.server``: ``create_app(settings)``, the FastAPI app over them.
* ``draftwise.remote.client``: ``RemoteTarget`` and ``connect(url)``, a ``Target`` for the engine.
"""
