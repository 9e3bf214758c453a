"""``pitools serve``: the runtime behind an OpenAI-compatible HTTP API (docs/how-to/serve.md).

``app.py`` is the HTTP side (routes, authentication, errors); ``uvicorn_server.py`` the HTTP/1.1 server
under it (read timeouts, JSON answers to malformed requests, shutdown that ends streams cleanly);
``json_body.py`` reads request bodies within bounds; ``protocol.py`` the request and response bodies of
OpenAI's protocol; ``scheduler.py`` queues requests for the one model; ``chat_template.py`` renders a
chat as the model's own template says, in the bounded process of ``template_sandbox.py``;
``stop_strings.py`` ends text at a stop string; ``metrics.py`` counts what the server did. The HTTP stack
(Starlette, uvicorn) and Jinja2 come with the ``serve`` extra: ``pip install 'powerinfer-tools[serve]'``.
"""
