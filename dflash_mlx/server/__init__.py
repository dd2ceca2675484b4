"""``dflash-mlx serve``: an OpenAI-compatible HTTP server over one DFlash pair.

``command`` loads the pair and runs uvicorn; ``app`` holds the routes,
``anthropic`` Anthropic's Messages API over the same machinery,
``responses`` OpenAI's Responses API (Codex's) onto the chat route and
``responses_stream`` its items and events,
``schemas`` the request bodies, ``prompts`` turns them into token ids,
``images`` reads their images,
``jobs`` the queued requests and their events, ``engine`` runs them on the
MLX worker thread (up to ``--max-concurrency`` at once as the rows of one
batch, ``batch``; one at a time where they cannot batch), ``stops``
cuts the text at stop strings, ``parts`` splits a chat reply into answer,
reasoning and tool calls and ``prefix_cache`` reuses the caches of
earlier requests whose prompts the new one extends.
"""
