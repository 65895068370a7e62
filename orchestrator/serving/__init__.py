"""The HTTP front end: llama-server's and OpenAI's API (and Anthropic's messages) over the engine."""
