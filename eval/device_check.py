"""`python eval/device_check.py --device cuda --out ...`: the accelerator check (eval/device/check.py) as a script,
for a device machine that has the working tree and no installed package."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).parent / "device" / "check.py"), run_name="__main__")
