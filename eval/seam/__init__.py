"""`python -m eval seam`: every policy's per-token NLLs in every path, recorded and compared."""
