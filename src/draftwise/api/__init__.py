"""The OpenAI-compatible inference server (needs the ``server`` extra: fastapi, uvicorn,
prometheus-client).

    from draftwise.api.app import create_app
    from draftwise.api.settings import ServerSettings
    from draftwise.prepare import prepare_pair

    settings = ServerSettings(target="tiny:0", drafter="ngram")
    pair = prepare_pair(
        settings.target, settings.draft, settings.models, settings.generation.draft, slots=settings.slots
    )
    app = create_app(settings, pair)

This package's ``__init__`` imports nothing, so the CLI can read ``ServerSettings`` for its
flags without loading the web stack.
"""
