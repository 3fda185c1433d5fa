"""The gateway's HTTP APIs: KServe v2 REST (Triton's flavour, with the binary tensor and
generate extensions) and an OpenAI-compatible API, on one aiohttp listener (`--http-port`)."""
