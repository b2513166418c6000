"""The `atom` command: serve, generate, chat, convert (and bench, when installed)."""
