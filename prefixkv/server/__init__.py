"""OpenAI-compatible HTTP server for prefixkv (``prefixkv serve``): ``app`` (aiohttp routes, SSE),
``protocol`` (msgspec Structs of the wire format), ``metrics`` (prometheus-client). aiohttp, msgspec and
prometheus-client are imported only here, so the engine runs without them."""
