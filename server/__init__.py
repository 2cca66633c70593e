"""The server: two processes, a package each, and the wire between them.

``server.api`` is the HTTP process (no torch); ``server.engine`` is the engine process that holds
every model's weights (no web stack); ``server.messages`` is all they share, beside the
torch-free ``model`` modules. docs/architecture.md draws the whole picture.

One request, by the name it has at each hop: a ``CompletionRequest`` (the HTTP body, pydantic)
becomes a ``Job`` in the API process (its events' queue, ``server.api.job``), travels as a
``Submit`` frame, and is a ``Request`` in the engine (``server.engine.engine``): the engine's
record of the job, which is also the ``model.decode.Row`` its batch decodes. Its tokens come back
as ``Token`` events inside ``Outputs`` frames, which the writers turn into OpenAI chunks.
"""
