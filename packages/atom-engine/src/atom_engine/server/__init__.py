"""`atom serve`: an OpenAI-compatible HTTP server (`api_server.build_app`) over an `AsyncEngine`."""
