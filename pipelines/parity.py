"""DVC stage 'parity' of one sweep point: python pipelines/parity.py POINT (posttrainllm/lab/stages/parity.py)."""

import sys

from posttrainllm.lab.pipeline import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("parity", sys.argv[1:]))
