"""A torchrun worker that hangs, as a rank waiting for a message that never comes does:
it leaves a file named by its process id in the folder given, then sleeps for an hour.
`test_launch.py` checks that `launch.torchrun` stops it."""
import os
import sys
import time
from pathlib import Path

Path(sys.argv[1], f"{os.getpid()}.pid").touch()
time.sleep(3600)
