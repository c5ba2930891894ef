"""The live dashboard (``draftwise dashboard``): watch speculation happen, token by token.

The Streamlit page (``page.py``, started through ``app.py``) is a client of the
OpenAI-compatible API: it streams a generation with per-token provenance and draws it. The
logic behind the page is plain functions, testable without Streamlit:

* ``client``: the HTTP client (SSE stream, health) and request building from settings;
* ``live``: stream chunks -> a per-token, per-step model of one run, and run comparison;
* ``render``: that model -> HTML of coloured tokens, plus the legend;
* ``charts``: that model -> chart tables;
* ``report``: a ``draftwise bench`` output folder -> tables and plots to browse.
"""
