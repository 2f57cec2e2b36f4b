import sys

from megahash.cli import main

sys.exit(main())
