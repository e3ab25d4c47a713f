import sys

from posttrainllm.cli import main

sys.exit(main())
