"""``python -m launch``: see launch/run.py."""
import sys

from launch.run import main

sys.exit(main())
