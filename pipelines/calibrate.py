"""DVC stage 'calibrate': this device's peaks, remeasured only when the device fingerprint changes."""

import sys
from pathlib import Path

from posttrainllm.lab.pipeline import write_calibration

if __name__ == "__main__":
    sys.exit(write_calibration(Path(sys.argv[1])))
