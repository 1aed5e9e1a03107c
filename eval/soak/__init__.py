"""`python -m eval soak`: long chats (chat) and generated text (defaults)."""
