"""``pitools serve``: the runtime behind an OpenAI-compatible HTTP API (docs/serving.md).

``app.py`` is the HTTP side (routes, authentication, errors); ``protocol.py`` the request and response
bodies of OpenAI's protocol; ``scheduler.py`` queues requests for the one model; ``chat_template.py``
renders a chat as the model's own template says; ``stop_strings.py`` ends text at a stop string;
``metrics.py`` counts what the server did. The HTTP stack (Starlette, uvicorn) and Jinja2 come with the
``serve`` extra: ``pip install 'powerinfer-tools[serve]'``.
"""
