"""``python -m sylvie_comm.demo ...`` is ``sylvie-comm demo ...``."""

import sys

from sylvie_comm.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
