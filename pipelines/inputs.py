"""DVC stage 'inputs': what each point's stages run and read, hashed (see posttrainllm/lab/sweep.py `stage_inputs`)."""

import sys
from pathlib import Path

from posttrainllm.config import ConfigError
from posttrainllm.lab.pipeline import PARAMS
from posttrainllm.lab.sweep import write_inputs

if __name__ == "__main__":
    try:
        sys.exit(write_inputs(PARAMS, Path(sys.argv[1])))
    except ConfigError as exc:
        print(f"posttrainllm: config error: {exc}", file=sys.stderr)
        sys.exit(2)
