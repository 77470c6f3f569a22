"""An OpenAI-compatible HTTP endpoint in front of the Triton server (`dspark serve --openai-port`).

A thin ASGI app (Starlette on uvicorn) that speaks OpenAI's `/v1/models`, `/v1/completions` and
`/v1/chat/completions` and forwards each request to the dspark model over Triton's gRPC streaming
API, so the engine stays behind Triton. Modules, one job each:

- `protocol`: OpenAI request bodies read into a GenerationRequest.
- `chat`: chat messages to prompt token ids through the model's chat template.
- `triton`: the served model on Triton (configuration, readiness, a request's stream).
- `generation`: one request's responses as Pieces; cancelling it closes its stream.
- `responses` and `logprobs`: OpenAI's response bodies, whole and chunked.
- `streaming`: server-sent events (and whole bodies) from a Generation.
- `errors`: OpenAI's error shape and the status of each model error.
- `app`: the routes; `server`: the process (`python -m dspark.serving.openai_frontend`).
"""
