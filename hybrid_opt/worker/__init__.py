"""The host tier's worker process: `protocol` (messages), `client` (trainer side), `main` (worker side)."""
