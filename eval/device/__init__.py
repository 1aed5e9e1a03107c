"""`python -m eval device` (or `python eval/device_check.py`): the accelerator check."""
