"""What the tests share: tiny models and their files, the oracle of the exact-mode rules, the policy matrix, and the
helpers of each app's tests (importable as `support.<module>`: conftest.py puts tests/ on sys.path)."""
