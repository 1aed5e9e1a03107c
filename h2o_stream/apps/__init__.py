"""Applications built on the engine: streaming perplexity, endless chat, long-document summarization."""
