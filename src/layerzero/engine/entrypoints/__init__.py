"""The engine's network entry points: ``openai`` (the OpenAI-compatible HTTP server of ``layerzero serve``).

Nothing here is imported by ``import layerzero`` or ``import layerzero.engine``; the web libraries (FastAPI,
uvicorn, prometheus-client) are imported inside the server's functions.
"""
