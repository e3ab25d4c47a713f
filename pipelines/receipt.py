"""DVC stage 'receipt' of one sweep point: python pipelines/receipt.py POINT (posttrainllm/lab/stages/receipt.py)."""

import sys

from posttrainllm.lab.pipeline import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("receipt", sys.argv[1:]))
