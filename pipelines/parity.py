"""DVC stage 'parity' of one sweep point: python pipelines/parity.py POINT (see posttrainllm/stages.py)."""

import sys

from posttrainllm.pipeline import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("parity", sys.argv[1:]))
