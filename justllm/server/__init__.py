"""The OpenAI-compatible HTTP server: ``create_app(engine, config)`` builds the Litestar app."""
