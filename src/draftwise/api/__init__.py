"""The OpenAI-compatible inference server (needs the ``server`` extra: fastapi, uvicorn,
prometheus-client).

    from draftwise.api.app import create_app
    from draftwise.api.settings import ServerSettings

    app = create_app(ServerSettings(target="tiny:0", drafter="ngram"))

This package's ``__init__`` imports nothing, so the CLI can read ``ServerSettings`` for its
flags without loading the web stack.
"""
