"""DVC stage 'kernel' of one sweep point: python pipelines/kernel.py POINT (posttrainllm/lab/stages/kernel.py)."""

import sys

from posttrainllm.lab.pipeline import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("kernel", sys.argv[1:]))
