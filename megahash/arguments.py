"""argparse's parser with the house rule's errors: a bad value, an unknown flag or a missing value is one line
``error: PROG: MESSAGE (see PROG --help)`` on stderr and exit status 2, as every other bad input (argparse prints
its usage block before the message). Every megahash command builds its parser from it; subparsers are of the
same class. Its own module: :mod:`megahash.errors` is copied into exported remote code, which imports no argparse."""

from __future__ import annotations

import argparse
import sys

from megahash.errors import print_error


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose :meth:`error` is one line (module docstring)."""

    def error(self, message: str):
        print_error(f"{self.prog}: {message} (see {self.prog} --help)")
        sys.exit(2)
