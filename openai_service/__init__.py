"""An OpenAI-compatible HTTP front over the target service: `deltaspec serve-openai` (docs/openai.md).

app.py (the ASGI app, its routes and the gRPC channel made in its lifespan) reads requests through schema.py
(OpenAI's JSON into one typed `Request`), answers in OpenAI's shapes from responses.py (whole responses and
streamed chunks), refuses in OpenAI's error shape from errors.py (a gRPC status to an HTTP status), and counts
time to first token and per output token in metrics.py.
"""
