"""`python -m eval needle`: passkey retrieval through the cache, and its accuracy grids and heat maps."""
