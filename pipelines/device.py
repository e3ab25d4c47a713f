"""DVC stage 'device': this machine's fingerprint, so timings are never restored from another device."""

import sys
from pathlib import Path

from posttrainllm.lab.pipeline import write_fingerprint

if __name__ == "__main__":
    sys.exit(write_fingerprint(Path(sys.argv[1])))
