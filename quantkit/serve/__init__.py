"""quantkit.serve: the OpenAI-compatible HTTP server over the engine's async front (AsyncLLM).

protocol (request bodies), sampling (fields -> SamplingParams), responses (bodies and SSE chunks),
generation (one HTTP request's engine requests), errors, auth, chat_template, routes/, app
(build_app), runner (uvicorn with our signal handling), settings (ServeSettings).
"""
