"""``python -m sylvie_comm.bench kernels ...`` is ``sylvie-comm bench kernels ...``."""

import sys

from sylvie_comm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
