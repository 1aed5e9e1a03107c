"""`python -m eval device` (or `python eval/device/check.py`): the accelerator check."""
