"""Host-agnostic layers models are built from."""
