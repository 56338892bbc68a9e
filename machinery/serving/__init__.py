"""Serving: serve.py's HTTP API (OpenAI's completions and chat, streams, the tokenizer's routes) and its web page.
Imports every other wing but training/."""
