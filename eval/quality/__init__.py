"""`python -m eval quality`: fair chunks against exact mode, and a real model streamed against its own forward."""
